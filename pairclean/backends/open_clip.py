"""Estimators: frozen dual encoders that map the left and right items of pairs to unit vectors.

The Estimator protocol is small so other backends can plug in: a picklable `preparer` (runs in
DataLoader workers: decode + preprocess images, tokenise texts), `encode(modality, batch)` on the
device, and `random_batch(modality, n, generator)` for the cone bias beta.
"""

from __future__ import annotations

import hashlib
import logging
import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Protocol

import torch

from pairclean.backends.accel import (CompiledOrEager, DeviceJpegDecoder, RawJpeg, collate_images, device_decodable,
                             notice_once, supports_text_trim, bucketed_encode_text)
from pairclean.data.decode import decode_image
from pairclean.errors import UserError

CONFIG_DIR = Path(__file__).parent / "model_configs"
PRECISIONS = ("fp32", "bf16", "fp16")
DECODES = ("fast", "exact", "gpu")


class Preparer(Protocol):
    def prepare(self, modality: str, value: Any) -> Any: ...
    def collate(self, modality: str, items: list) -> Any: ...


class Estimator(Protocol):
    preparer: Preparer
    device: torch.device

    def encode(self, modality: str, batch: Any) -> torch.Tensor: ...
    def random_batch(self, modality: str, n: int, generator: torch.Generator) -> Any: ...
    def provenance(self) -> dict: ...


def pick_device(requested: str = "auto") -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError as exc:
        raise UserError(f"unknown device {requested!r}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {requested} requested but CUDA is not available")
    return device


def autocast_context(device: torch.device, precision: str):
    """Autocast for bf16/fp16; fp16 only on CUDA (CPU fp16 matmuls are slow and lossy)."""
    if precision not in PRECISIONS:
        raise UserError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if precision == "fp32":
        return nullcontext()
    if precision == "fp16" and device.type != "cuda":
        raise UserError("--precision fp16 needs a CUDA device; use bf16 or fp32 on CPU")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def cpu_bf16_native() -> bool:
    """True when this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX): bf16 autocast then
    beats fp32; elsewhere oneDNN emulates it, usually slower than fp32."""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((line for line in fh if line.startswith("flags")), "").split()
        if flags:
            return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        pass
    try:  # not Linux: oneDNN's own check (true on some CPUs that only emulate bf16)
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_precision(device: str | torch.device, precision: str) -> str:
    """`auto` -> the fastest safe precision here: bf16 (or fp16) on CUDA, bf16 on CPUs with native
    bf16, fp32 otherwise. Explicit choices pass through, with a notice when bf16 is emulated."""
    device = device if isinstance(device, torch.device) else pick_device(device)
    if precision == "auto":
        if device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "bf16" if device.type == "cpu" and cpu_bf16_native() else "fp32"
    autocast_context(device, precision)  # UserError for unknown / impossible combinations
    if precision == "bf16" and device.type == "cpu" and not cpu_bf16_native():
        notice_once("bf16-emulated", "this CPU has no native bf16 (AVX512-BF16/AMX): --precision bf16 is emulated "
                                     "and probably slower than fp32")
    return precision


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def random_vocabulary_texts(words: list[str], n: int, generator: torch.Generator, max_words: int = 15) -> list[str]:
    """n random texts of 1..max_words vocabulary entries: beta's random inputs for Hugging Face tokenizers."""
    lengths = torch.randint(1, max_words + 1, (n,), generator=generator)
    return [" ".join(words[i] for i in torch.randint(0, len(words), (int(k),), generator=generator)) for k in lengths]


def register_model_configs() -> None:
    """Make pairclean's own open_clip configs (the tiny toy-world models) loadable by name."""
    import open_clip

    if CONFIG_DIR.is_dir() and any(CONFIG_DIR.glob("*.json")):
        open_clip.add_model_config(CONFIG_DIR)


class OpenClipPreparer:
    """Decode + preprocess images and tokenise texts with the model's own transforms."""

    def __init__(self, preprocess, tokenizer, draft_size: int | None, device_jpeg: bool = False):
        self.preprocess = preprocess
        self.tokenizer = tokenizer
        self.draft_size = draft_size
        self.device_jpeg = device_jpeg  # leave JPEGs undecoded for the device (--decode gpu)

    def prepare(self, modality: str, value: Any) -> Any:
        if modality == "image":
            if self.device_jpeg and device_decodable(value):
                return RawJpeg(torch.frombuffer(bytearray(value), dtype=torch.uint8))
            return self.preprocess(decode_image(value, draft_size=self.draft_size))
        return value

    def collate(self, modality: str, items: list) -> Any:
        if modality == "image":
            return collate_images(items)
        return self.tokenizer(items)


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


def _plain_encode_image(model: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    return model.encode_image(pixels)


def _plain_encode_text(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model.encode_text(tokens)


class OpenClipEstimator:
    """Any open_clip model: a pretrained tag, a local checkpoint file, or `none` (random init)."""

    def __init__(self, model: str = "ViT-B-32", pretrained: str = "openai", device: str = "auto",
                 precision: str = "fp32", decode: str = "fast", compile: bool = False):
        import open_clip

        register_model_configs()
        self.device = pick_device(device)
        self.precision = resolve_precision(self.device, precision)
        if decode not in DECODES:
            raise UserError(f"unknown decode {decode!r}; choose one of {', '.join(DECODES)}")
        if model not in open_clip.list_models():
            raise UserError(f"unknown model {model!r}: see `python -c 'import open_clip; print(open_clip.list_models())'`")
        self.model_name = model
        self.pretrained = pretrained
        weights = None if pretrained in (None, "", "none") else pretrained
        self.checkpoint_sha256 = None
        if weights is not None and os.path.isfile(weights):
            self.checkpoint_sha256 = file_sha256(weights)
        elif weights is not None and weights not in open_clip.list_pretrained_tags_by_model(model):
            tags = ", ".join(open_clip.list_pretrained_tags_by_model(model)) or "none"
            raise UserError(f"--pretrained {weights!r} is neither a file nor a tag of {model} (tags: {tags}); use a checkpoint path or `none`")
        try:
            logging.getLogger().setLevel(logging.ERROR)  # open_clip warns on purpose-made random init
            net, _, preprocess = open_clip.create_model_and_transforms(model, pretrained=weights, device=self.device, weights_only=True)
        except UserError:
            raise
        except Exception as exc:
            first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            if weights is not None and not os.path.isfile(weights):
                raise UserError(f"cannot fetch pretrained weights {weights!r} for {model} (offline?): {first}. "
                                "Pass a local checkpoint with --pretrained PATH, or --pretrained none") from None
            raise UserError(f"cannot load {model} with --pretrained {pretrained}: {first}") from None
        net.eval().requires_grad_(False)
        if self.precision != "fp32":
            # Matmul weights stored in the autocast dtype once (open_clip's own bf16/fp16 mode):
            # autocast re-casts weights that need no grad on every call, which on a CPU costs
            # more than bf16 saves (measured: 0.8x fp32 without this, 2.2x with it).
            from open_clip.model import convert_weights_to_lp

            convert_weights_to_lp(net, torch.bfloat16 if self.precision == "bf16" else torch.float16)
        self.channels_last = self.device.type == "cuda"  # conv stems on tensor cores; no gain measured on CPU
        if self.channels_last:
            net.visual.to(memory_format=torch.channels_last)
            torch.backends.cudnn.benchmark = True  # image batches have one fixed shape
        self.model = net
        self.tokenizer = open_clip.get_tokenizer(model)
        self.mean, self.std, self.image_size = _normalize_params(preprocess)
        self.device_decoder = None
        if decode == "gpu":
            if self.device.type != "cuda":
                notice_once("decode-gpu", "--decode gpu needs a CUDA device: decoding JPEGs in the CPU workers (fast)")
                decode = "fast"
            elif not DeviceJpegDecoder.supports(preprocess):
                notice_once("decode-gpu", f"--decode gpu: {model}'s preprocessing is not Resize + CenterCrop + "
                                          "Normalize; decoding JPEGs in the CPU workers (fast)")
                decode = "fast"
            else:
                self.device_decoder = DeviceJpegDecoder(preprocess, self.device)
        self.decode = decode
        draft = self.image_size if decode in ("fast", "gpu") else None  # gpu: non-JPEGs still decode on CPU
        self.preparer = OpenClipPreparer(preprocess, self.tokenizer, draft, device_jpeg=self.device_decoder is not None)
        # The text tower runs only up to each batch's longest caption when that is exact (see accel).
        # The towers take the model as an argument: a copy of this estimator with another
        # `.model` (training's frozen online estimator) encodes with its own weights.
        self.text_trim = supports_text_trim(net)
        encode_text = bucketed_encode_text if self.text_trim else _plain_encode_text
        self.compile = compile
        if compile:
            self._encode_image = CompiledOrEager(_plain_encode_image, "image")
            self._encode_text = CompiledOrEager(encode_text, "text", dynamic=True if self.text_trim else None)
        else:
            self._encode_image, self._encode_text = _plain_encode_image, encode_text

    @torch.no_grad()
    def encode(self, modality: str, batch: torch.Tensor) -> torch.Tensor:
        batch = batch.to(self.device, non_blocking=True)
        with autocast_context(self.device, self.precision):
            if modality == "image":
                if self.channels_last:
                    batch = batch.contiguous(memory_format=torch.channels_last)
                out = self._encode_image(self.model, batch)
            else:
                out = self._encode_text(self.model, batch)
        return torch.nn.functional.normalize(out.float(), dim=-1)

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

    def provenance(self) -> dict:
        return {"backend": "open_clip", "model": self.model_name, "pretrained": self.pretrained,
                "checkpoint_sha256": self.checkpoint_sha256, "precision": self.precision,
                "device": str(self.device), "decode": self.decode, "image_size": self.image_size,
                "image_mean": self.mean, "image_std": self.std}


BACKEND_MODALITIES = {"open_clip": ("image", "text"), "sentence-transformers": ("text",)}
BACKEND_DEFAULT_MODEL = {"open_clip": "ViT-B-32", "sentence-transformers": "all-MiniLM-L6-v2"}
BACKEND_ALIASES = {"open-clip": "open_clip", "openclip": "open_clip", "sentence_transformers": "sentence-transformers",
                   "st": "sentence-transformers"}


def check_backend(backend: str, needed: tuple[str, ...] = ()) -> str:
    """The canonical backend name; UserError if unknown or if it cannot encode a needed modality."""
    name = BACKEND_ALIASES.get(backend, backend)
    if name not in BACKEND_MODALITIES:
        raise UserError(f"unknown backend {backend!r}; choose {' or '.join(BACKEND_MODALITIES)}")
    missing = [m for m in dict.fromkeys(needed) if m not in BACKEND_MODALITIES[name]]
    if missing:
        raise UserError(f"the {name} backend cannot encode {', '.join(missing)}: "
                        f"it encodes {', '.join(BACKEND_MODALITIES[name])} only")
    return name


def build_estimator(backend: str = "open_clip", **kwargs) -> Estimator:
    name = check_backend(backend)
    if name == "sentence-transformers":
        from pairclean.backends.sentence_transformers import SentenceTransformerEstimator

        return SentenceTransformerEstimator(model=kwargs.get("model", "all-MiniLM-L6-v2"),
                                            device=kwargs.get("device", "auto"),
                                            precision=kwargs.get("precision", "fp32"))
    return OpenClipEstimator(**kwargs)
