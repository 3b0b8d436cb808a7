"""The open_clip backend: any open_clip model as a frozen estimator (image and text) or a training target.

A model is named by an open_clip architecture (pairclean's own tiny configs included) plus a
pretrained tag, a local checkpoint file, or `none` (random init); or by a name with open_clip's
schema, `hf-hub:ORG/REPO` (how LAION and DataComp publish their models: config and weights from the
Hugging Face Hub) or `local-dir:PATH` (a directory holding them), whose weights are its own
(`pretrained` unset, or `none` for random weights of that architecture).
"""

from __future__ import annotations

import copy
import difflib
import logging
import math
import os
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from pairclean.backends.base import (Backend, attempted, autocast_context, file_sha256, frozen_copy, move_batch,
                                     pick_device, random_vocabulary_texts, register_backend, resolve_precision)
from pairclean.backends.compiled import CompiledOrEager, RowPadding, pad_rows, tower_state
from pairclean.backends.oom import is_out_of_memory
from pairclean.backends.checkpoint_model import checkpoint_models
from pairclean.backends.device_jpeg import DEVICE_DECODERS, DeviceDecoder, check_cpu_decode_share, device_takes
from pairclean.backends.inputs import (DecodedImages, DeviceImages, ImageBatch, JpegBlob, PixelNormalizer, StandardTransform,
                                       TokenBatch, stack_pixels)
from pairclean.backends.hub import check_fetchable
from pairclean.backends.text_trim import (TextCuts, bucketed_encode_text, clip_text_tower, supports_text_trim, token_ends,
                                          trimmed_encode_text)
from pairclean.data.decode import decode_image, decode_plain_jpeg, plain_jpeg
from pairclean.errors import ConfigError, UserError
from pairclean.ops.atomic import atomic_path
from pairclean.ops.notices import notice_once
from pairclean.ops.records import JsonObject, Keyed

CONFIG_DIR = Path(__file__).parent / "model_configs"
SCHEMAS = ("hf-hub:", "local-dir:")  # open_clip's model names that carry their own config and weights
DEFAULT_TAG = "openai"  # the weights of an architecture name when `pretrained` is not given
COMPILED_LENGTH_STEP = 16  # compiled text tower: caption cuts in steps of 16 tokens, 5 lengths up to CLIP's 77
# A worker decodes up to this many images (or images of this many bytes: a 30,000 x 440 panorama is 40 MB)
# before it resizes them (`OpenClipPreparer.prepare_many`).
IMAGE_RUN, IMAGE_RUN_BYTES = 16, 16 << 20


def register_model_configs() -> None:
    """Make pairclean's own open_clip configs (the tiny toy-world models) loadable by name."""
    import open_clip

    if CONFIG_DIR.is_dir() and any(CONFIG_DIR.glob("*.json")):
        open_clip.add_model_config(CONFIG_DIR)


class _BelowErrorFromOpenClip(logging.Filter):
    def __init__(self):
        super().__init__()
        import open_clip

        self.package = os.path.dirname(open_clip.__file__) + os.sep

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not record.pathname.startswith(self.package)


class _AsIfUnconfigured(logging.Handler):
    """Stands in for a bare root logger's missing handler: a record no other handler took goes to
    Python's last resort, as it would have without this one."""

    def emit(self, record: logging.LogRecord) -> None:
        logger = logging.getLogger(record.name)
        while logger is not None and logger is not logging.root:
            if logger.handlers:
                return
            logger = logger.parent if logger.propagate else None
        if logging.lastResort is not None and record.levelno >= logging.lastResort.level:
            logging.lastResort.handle(record)


@contextmanager
def _open_clip_logging_contained():
    """open_clip logs through the root logger (`logging.info`, `logging.warning`, e.g. on purpose-made
    random init), and on a root logger without handlers the first such call installs a stderr
    handler for the whole process. While open_clip builds a model: drop its records below ERROR,
    and keep root from being configured; afterwards the host's logging is exactly as it was."""
    root = logging.getLogger()
    quiet = _BelowErrorFromOpenClip()
    stand_in = _AsIfUnconfigured() if not root.handlers else None
    root.addFilter(quiet)
    if stand_in is not None:
        root.addHandler(stand_in)
    try:
        yield
    finally:
        if stand_in is not None:
            root.removeHandler(stand_in)
        root.removeFilter(quiet)


class OpenClipPreparer:
    """Decode images and tokenise texts in DataLoader workers, with the model's own transforms.

    Where the model's preprocessing is the standard chain, a worker applies only its geometry
    (resize, crop) and sends uint8 pixels; the device normalises them (`PixelNormalizer`). The
    resize is torch's (`StandardTransform.fast_pixels`) unless `exact` (PIL's, the model's own).
    With `device_jpeg`, whole JPEGs the device can decode are passed on undecoded (`device_takes`:
    progressive ones only if `device_progressive`; none of the `cpu_decode_share` the workers keep), and
    the other images are decoded here and sent at their own sizes, for the device to resize and
    crop with the rest (`ImageBatch`); with `device_resize`, every image is (`DecodedImages`); with
    `token_ends`, token ids come with each caption's end (`TokenBatch`), for a text tower that trims."""

    def __init__(self, preprocess, tokenizer, draft_size: int | None, device_jpeg: bool = False,
                 token_ends: bool = False, device_progressive: bool = True, cpu_decode_share: float = 0.0,
                 device_resize: bool = False, exact: bool = False):
        self.preprocess = preprocess
        self.tokenizer = tokenizer
        self.draft_size = draft_size
        self.exact = exact
        self.device_jpeg = device_jpeg
        self.device_resize = device_resize
        self.device_progressive = device_progressive
        self.cpu_decode_share = cpu_decode_share
        self.token_ends = token_ends
        self.transform = StandardTransform.parse(preprocess)  # None: workers run the whole preprocessing

    @property
    def worker_resize(self) -> str | None:
        """Who resizes the images the workers finish: torch (`fast_pixels`), PIL (`exact`, or a
        preprocessing torch's resize cannot reproduce), or None where the device resizes."""
        if self.device_jpeg or self.device_resize:
            return None
        return "pil" if self.exact or self.transform is None or not self.transform.resamplable else "torch"

    def leaving_to(self, decoder: type[DeviceDecoder] | None) -> "OpenClipPreparer":
        """This preparer leaving what `decoder` takes to the device: its JPEGs, or the resize of
        the images decoded here (None: nothing, the workers finish every image)."""
        prepared = copy.copy(self)
        prepared.device_jpeg = decoder is not None and not decoder.workers_decode
        prepared.device_resize = decoder is not None and decoder.workers_decode
        prepared.device_progressive = decoder.progressive if decoder is not None else True
        return prepared

    def prepare(self, modality: str, value: Any) -> Any:
        return self._finished(self._opened(value)) if modality == "image" else value

    def prepare_many(self, modality: str, values: list) -> list:
        """`prepare` of each value, in order, with the exception it raised in place of a failed one's
        item. Images a run at a time (`IMAGE_RUN`): the run's decodes back to back, then their
        resizes - in a worker 0.05-0.11 ms an image less than alternating the two (docs/benchmarks.md)."""
        if modality != "image":
            return list(values)
        prepared, run, held = [], [], 0

        def finish_run() -> None:
            prepared.extend(item if isinstance(item, Exception) else attempted(self._finished, item) for item in run)
            run.clear()

        for value in values:
            run.append(attempted(self._opened, value))
            held += _held_bytes(run[-1])
            if len(run) == IMAGE_RUN or held >= IMAGE_RUN_BYTES:
                finish_run()
                held = 0
        finish_run()
        return prepared

    def _opened(self, value):
        """An image as far as a worker takes it before its geometry: the JPEG's bytes where the device
        decodes it, else the decoded image (`_decoded`)."""
        if self.device_jpeg and device_takes(value, self.device_progressive, self.cpu_decode_share):
            return bytes(value)  # decoded with the rest of its batch on the device
        return self._decoded(value)

    def _finished(self, image):
        """What the worker sends of an `_opened` image."""
        if isinstance(image, bytes):
            return image
        if self.device_jpeg or self.device_resize:
            return self.transform.device_sized(image)  # resized with its batch on the device
        if self.transform is None:
            return self.preprocess(image)
        return self.transform.geometry_pixels(image) if self.exact else self.transform.fast_pixels(image)

    def _decoded(self, value):
        """A worker's decode of an image: a plain JPEG by libjpeg as uint8 (3, H, W) pixels where
        torch or the device resizes (`decode_plain_jpeg`: PIL's pixels, a third sooner), a PIL
        image otherwise (and always for `exact`: PIL throughout)."""
        if self.worker_resize != "pil" and plain_jpeg(value, self.draft_size):
            pixels = decode_plain_jpeg(value)
            if pixels is not None:
                return pixels
        return decode_image(value, draft_size=self.draft_size)

    def collate(self, modality: str, items: list) -> Any:
        if modality != "image":
            tokens = self.tokenizer(items)
            return TokenBatch(tokens, token_ends(tokens)) if self.token_ends else tokens
        if self.device_resize:
            return DecodedImages.pack(items)
        if not self.device_jpeg:
            return stack_pixels(items)
        jpeg_rows = tuple(i for i, x in enumerate(items) if isinstance(x, bytes))
        decoded_rows = tuple(i for i, x in enumerate(items) if not isinstance(x, bytes))
        return ImageBatch(len(items), JpegBlob.pack([items[i] for i in jpeg_rows]), jpeg_rows,
                          DecodedImages.pack([items[i] for i in decoded_rows]) if decoded_rows else None, decoded_rows)


# Words open_clip's tokenizer remembers the BPE of: 230-290 bytes each (under 30 MB a worker), 14x the
# 7,119 words of COCO val2017's 25,014 captions.
WORD_MEMO_LIMIT = 100_000


class BoundedWordMemo(dict):
    """open_clip's `SimpleTokenizer.cache` - every word it has split into BPE tokens, kept forever -
    emptied back to its special tokens whenever it holds `limit` words. A memo only: the tokens are
    the same. Unbounded, it grows with every new word a worker meets: 300,000 captions, each a COCO
    caption with a new CJK phrase and a new word, left 607,119 words and 138 MB more resident;
    bounded, 24 MB, at the same speed (docs/benchmarks.md). Web captions (names, typos, URLs, text
    without spaces) bring new words without end."""

    def __init__(self, words: dict, limit: int = WORD_MEMO_LIMIT):
        super().__init__(words)
        self.kept, self.limit = dict(words), limit

    def __setitem__(self, word, tokens) -> None:
        if len(self) >= self.limit:
            self.clear()
            self.update(self.kept)
        super().__setitem__(word, tokens)

    def __reduce__(self):
        return type(self), (self.kept, self.limit)  # a worker starts from the special tokens


def with_bounded_word_memo(tokenizer):
    """`tokenizer` with its word memo bounded (`BoundedWordMemo`) where it is open_clip's own BPE
    tokenizer; any other (a Hugging Face tokenizer bounds its own) as it is."""
    if isinstance(getattr(tokenizer, "cache", None), dict) and hasattr(tokenizer, "bpe"):
        tokenizer.cache = BoundedWordMemo(tokenizer.cache)
    return tokenizer


def _held_bytes(image) -> int:
    """What an `_opened` image holds in memory until its run is finished."""
    if isinstance(image, torch.Tensor):
        return image.numel()
    return image.width * image.height * len(image.getbands()) if hasattr(image, "getbands") else 0


def _normalize_params(preprocess) -> tuple[list[float], list[float], int]:
    from torchvision.transforms import Normalize

    mean, std, size = [0.0, 0.0, 0.0], [1.0, 1.0, 1.0], 224
    for t in getattr(preprocess, "transforms", []):
        if isinstance(t, Normalize):
            mean, std = list(t.mean), list(t.std)
        if type(t).__name__ in ("CenterCrop", "Resize", "ResizeKeepRatio") and hasattr(t, "size"):
            s = t.size
            size = s if isinstance(s, int) else s[0]
    return mean, std, size


def _hub_files(tag_config: dict) -> tuple[str, list[str]] | None:
    """The Hub repository of a pretrained tag and the files open_clip looks for there, in its order
    (`open_clip.pretrained.download_pretrained`: a safetensors twin first); None for a tag that is
    not on the Hub."""
    from open_clip.constants import HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME

    if not tag_config.get("hf_hub"):
        return None
    repo_id, filename = os.path.split(tag_config["hf_hub"])
    filename = filename or HF_WEIGHTS_NAME
    twin = HF_SAFE_WEIGHTS_NAME if filename == HF_WEIGHTS_NAME else \
        filename[:-4] + ".safetensors" if filename.endswith((".bin", ".pth")) else None
    return repo_id, [name for name in (twin, filename) if name]


def _hub_text_files(model: str) -> list[tuple[str, str, list[str]]]:
    """(what, Hub repository, files) an architecture's text side fetches even with random weights:
    a Hugging Face tokenizer (the SigLIP models) and a Hugging Face text model's config (the
    multilingual ones; its weights only with `pretrained_text`, which pairclean leaves off). The
    first files each library asks for stand for the rest."""
    import open_clip

    text = (open_clip.get_model_config(model) or {}).get("text_cfg", {})
    files = []
    if text.get("hf_tokenizer_name"):
        files.append((f"the tokenizer files of {model} ({text['hf_tokenizer_name']})", text["hf_tokenizer_name"],
                      ["tokenizer_config.json", "tokenizer.json"]))
    if text.get("hf_model_name"):
        files.append((f"the text model's config of {model} ({text['hf_model_name']})", text["hf_model_name"],
                      ["config.json"]))
    return files


TEXT_WAYS = "Choose a `model` whose tokenizer and text tower come with open_clip (ViT-B-32, ViT-L-14, RN50, ...)"


def _schema_weights(model: str, pretrained: str) -> bool:
    """Whether a schema name (`hf-hub:`, `local-dir:`) loads its own weights (`pretrained` unset, i.e.
    the name itself) or none; refuse before any download what cannot be had (an hf-hub: repository
    neither cached nor reachable, a local-dir: without its config)."""
    from open_clip.constants import HF_CONFIG_NAME, HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME

    if pretrained not in (model, "none"):
        raise ConfigError(f"{model} brings its own weights: leave `pretrained` unset, or give none for random weights "
                          f"(a checkpoint file goes with an architecture name, e.g. `model` ViT-B-32 `pretrained` "
                          f"{pretrained})", "pretrained", "model")
    load = pretrained != "none"
    schema, _, name = model.partition(":")
    if not name:
        raise ConfigError(f"`model` {model} names no {'repository' if schema == 'hf-hub' else 'directory'}", "model")
    if schema == "local-dir":
        if not (Path(name) / HF_CONFIG_NAME).is_file():
            raise ConfigError(f"`model` {model}: {Path(name) / HF_CONFIG_NAME} not found (a local-dir: model is a "
                              "directory holding open_clip_config.json and its weights)", "model")
        return load
    checkpoint = "an architecture name with a local checkpoint file (e.g. ViT-B-32 with `pretrained` PATH)"
    check_fetchable(f"the config of {model}", name, [HF_CONFIG_NAME], f"Give {checkpoint}")
    if load:
        check_fetchable(f"the weights of {model}", name, [HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME],
                        f"Give `pretrained` none for random weights of its architecture, or {checkpoint}")
    return load


def _wrong_architecture(model: str, checkpoint: str, first: str) -> str | None:
    """Why a checkpoint did not load into `model`, when its shapes say which models it holds."""
    names, held = checkpoint_models(checkpoint)
    if held is None or model in names:
        return None
    if names:
        return (f"{checkpoint} holds {' / '.join(names)} ({held}), not {model} ({first}): give `model` "
                f"{names[0]}")
    return f"{checkpoint} holds {held}, not {model}, and no open_clip model config has these shapes ({first})"


def _plain_encode_image(model: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    return model.encode_image(pixels)


def _plain_encode_text(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model.encode_text(tokens)


def _matmul_weights_to(net: torch.nn.Module, dtype: torch.dtype) -> None:
    """open_clip's `convert_weights_to_lp`: linear, conv and attention weights and the towers'
    projection matrices in `dtype`. Its own fails where a projection is an nn.Linear, not a matrix
    (open_clip 3.3, the SigLIP text towers): here such a projection is converted as the Linear it is."""
    from open_clip.model import CLIP
    from open_clip.transformer import Attention, TextTransformer, VisionTransformer

    for module in net.modules():
        tensors = []
        if isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Linear)):
            tensors = [module.weight, module.bias]
        elif isinstance(module, (torch.nn.MultiheadAttention, Attention)):
            tensors = [getattr(module, f"{name}_proj_weight", None) for name in ("in", "q", "k", "v")]
            tensors += [getattr(module, name, None) for name in ("in_proj_bias", "bias_k", "bias_v")]
        if isinstance(module, (CLIP, TextTransformer)):
            tensors.append(getattr(module, "text_projection", None))
        if isinstance(module, VisionTransformer):
            tensors.append(getattr(module, "proj", None))
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):  # a Linear projection is a module, converted as one
                tensor.data = tensor.data.to(dtype)


def _in_stored_dtype(net: torch.nn.Module, modality: str) -> bool:
    """Whether a tower runs bf16/fp16 in its stored low-precision weights with autocast off, as
    open_clip's own bf16 mode does: open_clip's ViT and CLIP text transformer, whose fp32
    parameters are all ones they cast to their input's dtype themselves (`_fp32_leftovers`). On
    CUDA this lets MultiheadAttention take its fused path, which autocast shuts (ViT-B-32's image
    tower: 193 aten ops a call instead of 577). Other towers (timm, Hugging Face, ResNets,
    attentional pooling, layer scales) stay under autocast."""
    from open_clip.transformer import VisionTransformer

    if modality == "image":
        own = type(net.visual) is VisionTransformer and net.visual.attn_pool is None
        return own and not _fp32_leftovers(net.visual)
    return clip_text_tower(net) and not _fp32_leftovers(net, skip=("visual", "logit_scale", "logit_bias"))


def _for_cuda(net: torch.nn.Module, stored: list[str]) -> None:
    """What a model needs on CUDA that it does not on a CPU: the image tower channels-last (conv
    stems on tensor cores; no gain measured on CPU), cuDNN's autotuner (image batches have one
    fixed shape), and fp32 layer norms in the `stored` towers, those running in their stored
    bf16/fp16 dtype (`_layer_norms_in_fp32`)."""
    net.visual.to(memory_format=torch.channels_last)
    torch.backends.cudnn.benchmark = True
    _layer_norms_in_fp32(net, stored)


def _layer_norms_in_fp32(net: torch.nn.Module, modalities: list[str]) -> None:
    """CUDA: the layer norms of the towers that run in their stored dtype compute in fp32 on their
    bf16/fp16 input and give it back in that dtype (open_clip's `LayerNormFp32`, what its own bf16
    mode builds; autocast runs layer norms in fp32 too). CUDA's layer norm refuses a bf16/fp16
    input with the fp32 weights a CPU's takes ("expected scalar type BFloat16 but found Float",
    pytorch#138128); the CPU keeps its own mixed-dtype kernel, so CPU scores do not move."""
    from open_clip.transformer import LayerNormFp32

    for name, module in net.named_modules():
        tower = "image" if name.startswith("visual.") else "text"
        if isinstance(module, torch.nn.LayerNorm) and tower in modalities:  # as `_fp32_leftovers` exempts them
            module.__class__ = LayerNormFp32  # the same parameters; only its forward differs


SELF_CAST = ("class_embedding", "positional_embedding")  # cast to the activations' dtype where they are added


def _fp32_leftovers(tower: torch.nn.Module, skip: tuple[str, ...] = ()) -> list[str]:
    """The tower's fp32 parameters that would meet bf16 activations uncast (a layer scale's gamma,
    a head scale): all but layer norms' (a CPU's F.layer_norm takes bf16 input with fp32 weights;
    on CUDA they compute in fp32, `_layer_norms_in_fp32`), embedding tables (looked up, then cast)
    and SELF_CAST. `skip`: top-level names outside the tower."""
    owners = dict(tower.named_modules())
    left = []
    for name, param in tower.named_parameters():
        path, _, leaf = name.rpartition(".")
        if name.split(".")[0] in skip or param.dtype != torch.float32 or leaf in SELF_CAST:
            continue
        if not isinstance(owners[path], (torch.nn.LayerNorm, torch.nn.Embedding)):
            left.append(name)
    return left


def _compiled(tower) -> bool:
    """A tower still running compiled (not an eager function, not fallen back to eager)."""
    return isinstance(tower, CompiledOrEager) and tower.active


def _text_inputs(batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids and, where the batch brought them, each caption's end in host memory."""
    return (batch.tokens, batch.ends) if isinstance(batch, TokenBatch) else (batch, None)


def _close(name: str, known: list[str]) -> str:
    """`did you mean ...?` naming the known names closest to `name` (case-blind), or ""."""
    lowered = {k.lower(): k for k in known}
    close = [lowered[m] for m in difflib.get_close_matches(name.lower(), lowered, 3, 0.6)]
    return f"did you mean {' or '.join(close)}? " if close else ""


def check_model(model: str, pretrained: str | None) -> None:
    """Refuse a model name open_clip does not know, or weights that are neither a file nor one of
    its tags, before anything loads: one line with the names it may have meant."""
    import open_clip

    register_model_configs()
    if model.startswith(SCHEMAS):
        return
    if model not in open_clip.list_models():
        raise ConfigError(f"unknown model {model!r}: {_close(model, open_clip.list_models())}open_clip has no such "
                          "model (see `python -c 'import open_clip; print(open_clip.list_models())'`, or name a "
                          "Hugging Face repository as hf-hub:ORG/REPO); a sentence-transformers model, for text-text "
                          "pairs, needs `backend` sentence-transformers", "backend")
    weights = DEFAULT_TAG if pretrained is None else pretrained
    tags = open_clip.list_pretrained_tags_by_model(model)
    if weights not in ("", "none") and not os.path.isfile(weights) and weights not in tags:
        hint = _close(weights, tags) or f"its tags: {', '.join(tags) or 'none'}; "
        raise ConfigError(f"`pretrained` {weights!r} is neither a file nor a tag of {model}: {hint}use a checkpoint "
                          "path or `none`", "pretrained")


class OpenClipEstimator:
    """Any open_clip model: a pretrained tag, a local checkpoint file, or `none` (random init); None:
    the model's own weights (DEFAULT_TAG for an architecture name, its repository's for hf-hub:)."""

    @_open_clip_logging_contained()
    def __init__(self, model: str = "ViT-B-32", pretrained: str | None = None, device: str = "auto",
                 precision: str = "fp32", decode: str = "fast", compile: bool = False, cpu_decode_share: float = 0.0):
        import open_clip

        register_model_configs()
        self.device = pick_device(device)
        self.precision = resolve_precision(self.device, precision)
        self.cpu_decode_share = check_cpu_decode_share(cpu_decode_share, decode)  # and `decode`
        check_model(model, pretrained)
        schema_name = model.startswith(SCHEMAS)
        pretrained = (model if schema_name else DEFAULT_TAG) if pretrained is None else pretrained
        self.model_name = model
        self.pretrained = pretrained
        weights = None if pretrained in (None, "", "none") else pretrained
        self.checkpoint_sha256 = None
        if schema_name:
            weights = model if _schema_weights(model, pretrained) else None
        elif weights is not None and os.path.isfile(weights):
            self.checkpoint_sha256 = file_sha256(weights)
        elif weights is not None and (hub := _hub_files(open_clip.get_pretrained_cfg(model, weights))):
            # in seconds, not after a minute of download retries
            check_fetchable(f"the weights {weights!r} of {model}", *hub)
        if not schema_name:  # a tokenizer or text config from the Hub, with any weights: also in seconds
            for what, repo, files in _hub_text_files(model):
                check_fetchable(what, repo, files, ways=TEXT_WAYS, field="model")
        self.random_init = weights is None  # weights drawn at random, not learned
        try:
            # pretrained_text False: `pretrained` none means random weights, a Hugging Face text tower's too
            net, _, preprocess = open_clip.create_model_and_transforms(
                model, pretrained=None if schema_name else weights, load_weights=weights is not None,
                device=self.device, weights_only=True, pretrained_text=False)
        except UserError:
            raise
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if weights is not None and os.path.isfile(weights) and (why := _wrong_architecture(model, weights, first)):
                raise ConfigError(f"cannot load {model} with `pretrained` {weights}: {why}", "model", "pretrained") from None
            if weights is not None and not os.path.isfile(weights):
                raise ConfigError(f"cannot fetch the weights {weights!r} for {model} (offline?): {first}. "
                                  "Pass a local checkpoint with `pretrained` PATH, or `pretrained` none", "pretrained") from None
            raise ConfigError(f"cannot load {model} with `pretrained` {pretrained}: {first}", "pretrained") from None
        net.eval().requires_grad_(False)
        if self.precision != "fp32":
            # Matmul weights stored in the autocast dtype once (open_clip's own bf16/fp16 mode):
            # autocast re-casts weights that need no grad on every call, which on a CPU costs
            # more than bf16 saves (measured: 0.8x fp32 without this, 2.2x with it).
            _matmul_weights_to(net, torch.bfloat16 if self.precision == "bf16" else torch.float16)
        # bf16/fp16: towers in their stored dtype (autocast off) where they can, under autocast elsewhere
        self.autocast = {m: self.precision != "fp32" and not _in_stored_dtype(net, m) for m in ("image", "text")}
        self.channels_last = self.device.type == "cuda"  # conv stems on tensor cores; no gain measured on CPU
        if self.device.type == "cuda":
            _for_cuda(net, self.stored_towers)
        self.model = net
        self.tokenizer = with_bounded_word_memo(open_clip.get_tokenizer(model))
        self.mean, self.std, self.image_size = _normalize_params(preprocess)
        self.normalize = PixelNormalizer(self.mean, self.std)
        self.device_decoder = None
        transform = StandardTransform.parse(preprocess)
        if decode in DEVICE_DECODERS:
            self.device_decoder = self._device_decoder(DEVICE_DECODERS[decode], transform, preprocess, model)
            decode = decode if self.device_decoder is not None else "fast"
        self.decode = decode
        draft = self.image_size if decode != "exact" else None  # device decoders: non-JPEGs still decode on CPU
        # The text tower runs only up to each batch's longest caption when that is exact (see text_trim),
        # cut where the workers' `TokenBatch.ends` say. The towers take the model as an argument: a copy
        # of this estimator with another `.model` (training's frozen online estimator) uses its own weights.
        self.text_trim = supports_text_trim(net)
        self.preparer = OpenClipPreparer(preprocess, self.tokenizer, draft, token_ends=self.text_trim,
                                         cpu_decode_share=self.cpu_decode_share, exact=decode == "exact"
                                         ).leaving_to(type(self.device_decoder) if self.device_decoder else None)
        self.compile = compile
        # Compiled towers see few shapes: batches padded to the most rows seen, caption cuts in steps of 16.
        self.padding = RowPadding()
        if compile:
            self._image_tower = CompiledOrEager(_plain_encode_image, "image", self.device)
            self._text_tower = CompiledOrEager(trimmed_encode_text if self.text_trim else _plain_encode_text, "text",
                                               self.device, dynamic=True if self.text_trim else None)
        else:
            self._image_tower = _plain_encode_image
            self._text_tower = trimmed_encode_text if self.text_trim else _plain_encode_text

    def compiled_towers(self) -> Keyed[str, str]:
        """How each tower runs now (`compiled.tower_state`): a compiled figure is one where both say `compiled`."""
        return {"image": tower_state(self._image_tower), "text": tower_state(self._text_tower)}

    @property
    def text_cuts(self) -> TextCuts:
        """How a batch of captions goes through the text tower here: as compiled, while it is."""
        return TextCuts.for_device(self.device, _compiled(self._text_tower), COMPILED_LENGTH_STEP)

    def _device_decoder(self, cls, transform, preprocess, model: str):
        """The device decoder `decode` names, or None (said once) where it cannot run here: the
        workers then decode with PIL (fast)."""
        why = (cls.cannot_run(self.device)
               or (None if cls.supports(transform) else f"needs a bicubic or bilinear Resize + CenterCrop + Normalize "
                                                         f"preprocessing, which {model}'s is not"))
        if why is None:
            return cls(transform, self.device, preprocess)
        notice_once("decode-device", f"`decode` {cls.name} {why}: decoding JPEGs in the CPU workers (fast)", "decode")
        return None

    def finish_batch(self, modality: str, inputs: Any) -> tuple[Any, Keyed[int, str]]:
        """Device preprocessing of one side of a batch already moved to the device: JPEGs left
        undecoded (`decode` gpu) decoded, resized and cropped, or the workers' decoded images
        (`decode` gpu-resize) resized and cropped; {row: reason} for those that fail."""
        if isinstance(inputs, DeviceImages):
            return self.device_decoder(inputs)
        return inputs, {}

    def warm_up(self) -> None:
        """The device decoder's first-call costs, paid before the first batch (`DeviceDecoder.warm_up`)."""
        if self.device_decoder is not None:
            self.device_decoder.warm_up()

    @property
    def stored_towers(self) -> list[str]:
        """The towers that run in their stored bf16/fp16 weights, autocast off (`_in_stored_dtype`)."""
        return [m for m, under_autocast in self.autocast.items() if self.precision != "fp32" and not under_autocast]

    def tower_context(self, modality: str):
        """What a tower runs under: autocast, or nothing (fp32, or a tower in its stored dtype)."""
        return autocast_context(self.device, self.precision) if self.autocast[modality] else nullcontext()

    @torch.no_grad()
    def encode(self, modality: str, batch: torch.Tensor | TokenBatch) -> torch.Tensor:
        try:
            with self.tower_context(modality):
                out = self._encode(modality, batch)
        except Exception as exc:
            if is_out_of_memory(exc):
                self.padding.reset()  # the caller goes on in smaller chunks: padding back up would run out again
            raise
        return torch.nn.functional.normalize(out.float(), dim=-1)

    def _encode(self, modality: str, batch: torch.Tensor | TokenBatch) -> torch.Tensor:
        """The tower's output for `batch`'s rows (a compiled tower runs them padded: the padding's
        rows are zeros, each row's output its own, and they are dropped here)."""
        if modality == "image":
            pixels = batch.to(self.device, non_blocking=True)
            rows = pixels.shape[0]
            if _compiled(self._image_tower):
                pixels = pad_rows(pixels, self.padding.target("image", rows))
            return self._image_tower(self.model, self.image_input(pixels))[:rows]
        tokens, ends = _text_inputs(batch)
        rows = tokens.shape[0]
        if _compiled(self._text_tower):  # padded before the groups are cut
            target = self.padding.target("text", rows)
            tokens, ends = pad_rows(tokens, target), None if ends is None else pad_rows(ends, target, value=1)
        if not self.text_trim:
            return self._text_tower(self.model, tokens.to(self.device, non_blocking=True))[:rows]
        if ends is None:  # ids from the host (beta's random texts) cost nothing to read; from the device, a sync
            ends = token_ends(tokens).cpu()
        return bucketed_encode_text(self.model, tokens.to(self.device, non_blocking=True), ends,
                                    encode=self._text_tower, cuts=self.text_cuts)[:rows]

    def image_input(self, pixels: torch.Tensor) -> torch.Tensor:
        """The image tower's input: uint8 pixels normalised here, on the device, in the memory
        layout the tower runs fastest in (channels last on CUDA, contiguous on CPU)."""
        layout = torch.channels_last if self.channels_last else torch.contiguous_format
        pixels = self.normalize(pixels, layout)
        if "image" in self.stored_towers:  # the tower runs in its weights' dtype
            return pixels.to(self.model.visual.conv1.weight.dtype)
        return pixels

    def random_batch(self, modality: str, n: int, generator: torch.Generator) -> torch.Tensor:
        """Random inputs as the official OSA code draws them: noise images, random-token texts."""
        if modality == "image":
            pixels = torch.rand((n, 3, self.image_size, self.image_size), generator=generator)
            mean = torch.tensor(self.mean).view(1, 3, 1, 1)
            std = torch.tensor(self.std).view(1, 3, 1, 1)
            return (pixels - mean) / std
        tok = self.tokenizer
        ctx = getattr(tok, "context_length", 77)
        sot, eot = getattr(tok, "sot_token_id", None), getattr(tok, "eot_token_id", None)
        vocab = getattr(tok, "vocab_size", None)
        if sot is None or eot is None or vocab is None:
            # A Hugging Face tokenizer: random vocabulary words go through the tokenizer itself.
            return tok(random_vocabulary_texts(list(tok.tokenizer.get_vocab().keys()), n, generator))
        tokens = torch.zeros((n, ctx), dtype=torch.long)
        lengths = torch.randint(1, ctx - 1, (n,), generator=generator)
        for row, length in enumerate(lengths.tolist()):
            body = torch.randint(0, min(vocab, sot), (length,), generator=generator)
            tokens[row, 0] = sot
            tokens[row, 1:length + 1] = body
            tokens[row, length + 1] = eot
        return tokens

    def provenance(self) -> JsonObject:
        return {"backend": "open_clip", "model": self.model_name, "pretrained": self.pretrained,
                "checkpoint_sha256": self.checkpoint_sha256, "precision": self.precision,
                "device": str(self.device), "decode": self.decode, "worker_resize": self.preparer.worker_resize,
                "image_size": self.image_size,
                "image_mean": self.mean, "image_std": self.std,
                **({"autocast": self.autocast} if self.precision != "fp32" else {}),
                **({"device_decoder_version": self.device_decoder.version} if self.device_decoder else {}),
                **({"cpu_decode_share": self.cpu_decode_share} if self.device_decoder and self.cpu_decode_share else {})}

    def input_signature(self) -> tuple:
        """Image size and normalisation, tokenizer class and context length."""
        return ("open_clip", self.image_size, tuple(self.mean), tuple(self.std), type(self.tokenizer),
                getattr(self.tokenizer, "context_length", None))


class OpenClipTarget:
    """An open_clip model (pretrained tag, local checkpoint, or `none` = random init) under training."""

    backend = "open_clip"

    def __init__(self, model: str, pretrained: str, device: str = "auto", temperature: float | None = None,
                 decode: str = "fast"):
        self.estimator = OpenClipEstimator(model=model, pretrained=pretrained, device=device, precision="fp32",
                                           decode=decode)
        self.module = self.estimator.model
        self.module.requires_grad_(True).train()
        self.device = self.estimator.device
        # The training loop's loader leaves JPEGs for the device decoder, where one decodes (`decode`
        # gpu ...): the loop finishes its batches there. Every other loader (validation, a method's
        # scoring passes, a second network's) hands over pixels, decoded in its workers.
        self.loop_preparer = copy.copy(self.estimator.preparer)
        self.loop_preparer.token_ends = False  # training's methods index and concatenate plain token ids
        self.preparer = self.loop_preparer.leaving_to(None)
        self.temperature = temperature
        if temperature is not None:  # a fixed temperature replaces the learned one
            self.module.logit_scale.requires_grad_(False)
            with torch.no_grad():
                self.module.logit_scale.fill_(math.log(1.0 / temperature))

    def encode(self, modality: str, batch: torch.Tensor) -> torch.Tensor:
        batch = move_batch(batch, self.device)
        if modality == "image":
            out = self.module.encode_image(self.estimator.image_input(batch))
        else:
            out = self.module.encode_text(_text_inputs(batch)[0])
        return torch.nn.functional.normalize(out.float(), dim=-1)

    def logit_scale(self) -> torch.Tensor:
        return self.module.logit_scale.exp().clamp(max=100.0)  # CLIP's clamp at 100

    def frozen_estimator(self) -> OpenClipEstimator:
        return frozen_copy(self.estimator, self.module)

    def export(self, path: Path) -> Path:
        """A plain state_dict: `open_clip.create_model_and_transforms(name, pretrained=path)` loads it."""
        path = Path(path).with_suffix(".pt")
        with atomic_path(path) as tmp:
            torch.save(self.module.state_dict(), tmp)
        return path

    def describe(self) -> JsonObject:
        return {"backend": self.backend, "model": self.estimator.model_name, "pretrained": self.estimator.pretrained,
                "temperature": self.temperature, "image_size": self.estimator.image_size}


@register_backend
class OpenClipBackend(Backend):
    name = "open_clip"
    modalities = ("image", "text")
    default_model = "ViT-B-32"
    aliases = ("open-clip", "openclip")
    # open_clip's own ViT and text transformer run in their stored bf16/fp16 weights, autocast off
    # (`_in_stored_dtype`): on CPUs bit for bit what autocast gave; on CUDA (fp32 layer norms, fused
    # attention) expected within bf16 rounding of it - not yet measured on a GPU
    low_precision = "stored"
    decodes_images = True

    @classmethod
    def detects(cls, model: str) -> bool:
        """An open_clip model name: one of its architectures (pairclean's included) or a schema name."""
        import open_clip

        register_model_configs()
        return model.startswith(SCHEMAS) or model in open_clip.list_models()

    @classmethod
    def check_model(cls, model: str, pretrained: str | None) -> None:
        check_model(model, pretrained)

    @classmethod
    def estimator(cls, model: str, **options) -> OpenClipEstimator:
        return OpenClipEstimator(model, **options)

    @classmethod
    def target(cls, model: str, pretrained: str, device: str, temperature: float | None,
               decode: str = "fast") -> OpenClipTarget:
        return OpenClipTarget(model, pretrained, device=device, temperature=temperature, decode=decode)

    @classmethod
    def exported(cls, description: dict, weights: Path, device: str) -> OpenClipTarget:
        return OpenClipTarget(description["model"], str(weights), device=device)
