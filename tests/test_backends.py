"""The backend registry: one registered class gives the frozen estimator and the trainable target
through the same dispatch points, and building an estimator leaves the host's logging alone."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from helpers import text_pairs
from pairclean.backends import (BACKENDS, Backend, build_estimator, check_backend, default_model, detect_backend,
                                load_target, register_backend, resolve_backend)
from pairclean.backends.base import frozen_copy, move_batch, pick_device
from pairclean.errors import UserError
from pairclean.scorefile.contract import read_provenance
from pairclean.scoring.model import ScoreConfig, score
from pairclean.training import TrainConfig, train
from pairclean.training.retrieval import evaluate_retrieval


class BytePreparer:
    """Texts -> rows of byte ids + 1 (0 pads)."""

    def prepare(self, modality: str, value: str) -> str:
        return value

    def collate(self, modality: str, items: list[str]) -> torch.Tensor:
        rows = [list(text.encode()[:32]) or [0] for text in items]
        ids = torch.zeros((len(rows), max(map(len, rows))), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row) + 1
        return ids


class ByteEstimator:
    """Mean of byte embeddings: a text encoder small enough to build in a test."""

    def __init__(self, model: str, device: str = "auto", precision: str = "fp32"):
        self.model_name, self.device, self.precision = model, pick_device(device), precision
        self.model = torch.nn.EmbeddingBag(257, 8, mode="mean", padding_idx=0).to(self.device)
        self.model.eval().requires_grad_(False)
        self.preparer = BytePreparer()

    def finish_batch(self, modality: str, inputs: torch.Tensor) -> tuple[torch.Tensor, dict[int, str]]:
        return inputs, {}  # nothing to decode on the device

    def encode(self, modality: str, batch: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(self.model(move_batch(batch, self.device)).float(), dim=-1)

    def random_batch(self, modality: str, n: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randint(1, 257, (n, 16), generator=generator)

    def provenance(self) -> dict:
        return {"backend": "bytes", "model": self.model_name, "precision": self.precision, "device": str(self.device)}

    def input_signature(self) -> tuple:
        return ("bytes", 32)


class ByteTarget:
    backend = "bytes"

    def __init__(self, model: str, device: str, temperature: float | None):
        self.estimator = ByteEstimator(model, device)
        self.module = self.estimator.model.requires_grad_(True).train()
        self.device, self.preparer = self.estimator.device, self.estimator.preparer
        self.temperature = temperature or 0.1

    def encode(self, modality: str, batch: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(self.module(move_batch(batch, self.device)).float(), dim=-1)

    def logit_scale(self) -> torch.Tensor:
        return torch.tensor(1.0 / self.temperature, device=self.device)

    def frozen_estimator(self) -> ByteEstimator:
        return frozen_copy(self.estimator, self.module)

    def export(self, path: Path) -> Path:
        path = Path(path).with_suffix(".pt")
        torch.save(self.module.state_dict(), path)
        return path

    def describe(self) -> dict:
        return {"backend": self.backend, "model": self.estimator.model_name, "temperature": self.temperature}


class ByteBackend(Backend):
    name = "bytes"
    modalities = ("text",)
    default_model = "bytes-8"
    aliases = ("byte",)

    @classmethod
    def detects(cls, model: str) -> bool:
        return model.startswith("bytes-")

    @classmethod
    def estimator(cls, model: str, device: str = "auto", precision: str = "fp32", **open_clip_options) -> ByteEstimator:
        return ByteEstimator(model, device, precision)

    @classmethod
    def target(cls, model: str, pretrained: str, device: str, temperature: float | None) -> ByteTarget:
        return ByteTarget(model, device, temperature)

    @classmethod
    def exported(cls, description: dict, weights: Path, device: str) -> ByteTarget:
        target = ByteTarget(description["model"], device, description["temperature"])
        target.module.load_state_dict(torch.load(weights, weights_only=True))
        return target


@pytest.fixture
def byte_backend():
    register_backend(ByteBackend)
    yield ByteBackend
    BACKENDS.pop(ByteBackend.name)


@pytest.fixture(scope="module")
def text_pairs_manifest(tmp_path_factory, coco_src) -> Path:
    return text_pairs(coco_src, tmp_path_factory.mktemp("text-pairs") / "wds")


def test_a_registered_class_is_a_backend_for_every_dispatch_point(byte_backend):
    assert check_backend("byte") == "bytes" and default_model("bytes") == "bytes-8"
    with pytest.raises(UserError, match="the bytes backend cannot encode image"):
        check_backend("bytes", ("image", "text"))
    assert detect_backend("bytes-16") == "bytes" and resolve_backend("auto", "bytes-16", ("text",)) == "bytes"
    assert detect_backend("pairclean-tiny") == "open_clip" and detect_backend("all-MiniLM-L6-v2") == "sentence-transformers"

    estimator = build_estimator("byte", device="cpu", pretrained="ignored", decode="fast", compile=False)
    target = load_target("bytes-8", device="cpu")  # backend auto: recognised from the model name
    assert isinstance(estimator, ByteEstimator) and estimator.model_name == "bytes-8" and isinstance(target, ByteTarget)
    assert target.module.weight.requires_grad and not target.frozen_estimator().model.weight.requires_grad
    assert target.estimator.input_signature() == estimator.input_signature()
    with pytest.raises(UserError, match="unknown backend"):
        load_target("bytes-8", backend="tensorflow")


def test_a_registered_backend_scores_trains_and_reloads_end_to_end(byte_backend, text_pairs_manifest, tmp_path):
    torch.manual_seed(0)
    result = score(str(text_pairs_manifest), tmp_path / "scores.parquet",
                   ScoreConfig(backend="bytes", model="bytes-8", beta_k=16, batch_size=8, workers=0, device="cpu"))
    assert result.pairs_scored_now == 16 and read_provenance(tmp_path / "scores.parquet").estimator["backend"] == "bytes"
    assert pq.read_table(tmp_path / "scores.parquet").num_rows == 16
    trained = train(str(text_pairs_manifest), tmp_path / "run", TrainConfig(model="bytes-8", epochs=1, batch_size=8, workers=0,
                                                                  device="cpu", lr=1e-3, warmup_steps=1))
    assert len(trained.epochs) == 1 and trained.last_model.name == "model-epoch-001.pt" and trained.last_model.is_file()
    metrics = evaluate_retrieval(tmp_path / "run", str(text_pairs_manifest), device="cpu")  # reloaded by the backend it recorded
    assert 0.0 <= metrics.rsum <= 600.0


def test_building_an_estimator_leaves_the_root_logger_alone(caplog):
    root = logging.getLogger()
    before = (root.level, list(root.handlers), list(root.filters))
    build_estimator("open_clip", model="pairclean-tiny", pretrained="none", device="cpu")
    assert (root.level, list(root.handlers), list(root.filters)) == before
    # A host that configured no logging: open_clip's own logging.info/warning calls install no handler.
    handlers, root.handlers = root.handlers, []
    try:
        build_estimator("open_clip", model="pairclean-tiny", pretrained="none", device="cpu")
        assert root.handlers == []
    finally:
        root.handlers = handlers
    # open_clip's warning on purpose-made random init stays out of the host's logs.
    with caplog.at_level(logging.INFO):
        build_estimator("open_clip", model="pairclean-tiny", pretrained="none", device="cpu")
    assert "initialized randomly" not in caplog.text
