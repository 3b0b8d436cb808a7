"""Target models: the dual encoders pairclean trains (open_clip models, sentence-transformers bi-encoders).

A target exposes what the trainer, the loss and retrieval evaluation need: a picklable
`preparer` for DataLoader workers, `encode(modality, batch)` -> L2-normalised embeddings (with
gradients in train mode), `logit_scale()`, `export(path)` for a standalone model file, and
`describe()` for the run's config. open_clip targets are built through
`pairclean.backends.open_clip.OpenClipEstimator`, so loading, validation and preprocessing are the
scorer's own; sentence-transformers targets through `pairclean.backends.sentence_transformers`.
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import Any

import torch

from pairclean.ops.atomic import atomic_path
from pairclean.errors import UserError
from pairclean.backends.open_clip import OpenClipEstimator
from pairclean.data.writer import staged_directory
from pairclean.backends.sentence_transformers import SentenceTransformerEstimator, resolve_model

BACKENDS = ("auto", "open_clip", "sentence-transformers")
ST_DEFAULT_TEMPERATURE = 0.05  # sentence-transformers' MultipleNegativesRankingLoss scale 20


def _move(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, dict):
        return {k: _move(v, device) for k, v in batch.items()}
    return batch.to(device, non_blocking=True) if isinstance(batch, torch.Tensor) else batch


def _frozen_copy(estimator, module: torch.nn.Module):
    """The estimator around a frozen copy of the model as it is now (the official OSA code's online estimator)."""
    frozen = copy.copy(estimator)
    frozen.model = copy.deepcopy(module).eval().requires_grad_(False)
    return frozen


class OpenClipTarget:
    """An open_clip model (pretrained tag, local checkpoint, or `none` = random init) under training."""

    backend = "open_clip"

    def __init__(self, model: str, pretrained: str, device: str = "auto", temperature: float | None = None):
        self.estimator = OpenClipEstimator(model=model, pretrained=pretrained, device=device, precision="fp32")
        self.module = self.estimator.model
        self.module.requires_grad_(True).train()
        self.device = self.estimator.device
        self.preparer = self.estimator.preparer
        self.temperature = temperature
        if temperature is not None:  # a fixed temperature replaces the learned one
            self.module.logit_scale.requires_grad_(False)
            with torch.no_grad():
                self.module.logit_scale.fill_(math.log(1.0 / temperature))

    def encode(self, modality: str, batch: torch.Tensor) -> torch.Tensor:
        batch = _move(batch, self.device)
        out = self.module.encode_image(batch) if modality == "image" else self.module.encode_text(batch)
        return torch.nn.functional.normalize(out.float(), dim=-1)

    def logit_scale(self) -> torch.Tensor:
        return self.module.logit_scale.exp().clamp(max=100.0)  # CLIP's clamp at 100

    def frozen_estimator(self) -> OpenClipEstimator:
        return _frozen_copy(self.estimator, self.module)

    def export(self, path: Path) -> Path:
        """A plain state_dict: `open_clip.create_model_and_transforms(name, pretrained=path)` loads it."""
        path = Path(path).with_suffix(".pt")
        with atomic_path(path) as tmp:
            torch.save(self.module.state_dict(), tmp)
        return path

    def describe(self) -> dict:
        return {"backend": self.backend, "model": self.estimator.model_name, "pretrained": self.estimator.pretrained,
                "temperature": self.temperature, "image_size": self.estimator.image_size}


class SentenceTransformerTarget:
    """A sentence-transformers bi-encoder (one tower for both texts) with a fixed temperature."""

    backend = "sentence-transformers"

    def __init__(self, model: str, device: str = "auto", temperature: float | None = None):
        self.estimator = SentenceTransformerEstimator(model=model, device=device, precision="fp32")
        self.module = self.estimator.model
        self.module.requires_grad_(True).train()
        self.device = self.estimator.device
        self.preparer = self.estimator.preparer  # tokenises in the DataLoader workers
        self.temperature = temperature or ST_DEFAULT_TEMPERATURE
        self._scale = torch.tensor(1.0 / self.temperature, device=self.device)

    def encode(self, modality: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.module(_move(batch, self.device))["sentence_embedding"]
        return torch.nn.functional.normalize(out.float(), dim=-1)

    def logit_scale(self) -> torch.Tensor:
        return self._scale

    def frozen_estimator(self) -> SentenceTransformerEstimator:
        return _frozen_copy(self.estimator, self.module)

    def export(self, path: Path) -> Path:
        """A sentence-transformers model directory (`SentenceTransformer(path)` loads it)."""
        path = Path(path)
        with staged_directory(path, overwrite=True) as tmp:
            self.module.save(str(tmp))
        return path

    def describe(self) -> dict:
        return {"backend": self.backend, "model": self.estimator.model_name, "location": self.estimator.location,
                "temperature": self.temperature}


def is_sentence_transformer(model: str) -> bool:
    """A sentence-transformers directory, or a model a bundled offline package ships."""
    return os.path.isfile(os.path.join(model, "modules.json")) or resolve_model(model)[1] not in ("local", "hub")


def load_target(model: str, pretrained: str = "none", backend: str = "auto", device: str = "auto",
                temperature: float | None = None):
    """Build the target for training: open_clip by name, sentence-transformers by directory or name."""
    if backend not in BACKENDS:
        raise UserError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if temperature is not None and temperature <= 0:
        raise UserError("--temperature must be positive")
    if backend == "sentence-transformers" or (backend == "auto" and is_sentence_transformer(model)):
        return SentenceTransformerTarget(model, device=device, temperature=temperature)
    return OpenClipTarget(model, pretrained, device=device, temperature=temperature)
