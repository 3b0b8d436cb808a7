"""The cone bias beta (OSA Eq. 4): the mean cosine of random pairs through the same encoders.

`random-inputs` (default) pushes K random left inputs and K random right inputs (noise images,
random-token texts) through the estimator and averages all K x K cross cosines. `shuffled` is
the mean cosine of in-dataset pairs with one side permuted, accumulated while scoring from
per-part embedding sums (it sits inside the noisy distribution: a diagnostic, not a boundary).
`fixed` takes the user's value.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from pairclean.errors import ConfigError, UserError
from pairclean.ops.atomic import write_json

BETA_MODES = ("random-inputs", "shuffled", "fixed")


@dataclass
class BetaEstimate:
    mode: str
    beta: float
    std: float | None
    k: int | None
    seed: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def random_input_beta(estimator, left: str, right: str, k: int = 1024, seed: int = 0,
                      batch_size: int = 256) -> BetaEstimate:
    """beta = mean over all K x K cosines between K random left and K random right inputs."""
    generator = torch.Generator().manual_seed(seed)

    def embed(modality: str) -> torch.Tensor:
        chunks = []
        for start in range(0, k, batch_size):
            n = min(batch_size, k - start)
            chunks.append(estimator.encode(modality, estimator.random_batch(modality, n, generator)).double().cpu())
        return torch.cat(chunks)

    u = embed(left)
    v = embed(right)
    sims = u @ v.T
    return BetaEstimate("random-inputs", float(sims.mean()), float(sims.std()), k, seed)


class ShuffledAccumulator:
    """Streams sum(u), sum(v), sum(u_i . v_i) and n, so that the mean cosine over all i != j
    cross pairs is ((sum u).(sum v) - sum u_i.v_i) / (n (n - 1)) without storing embeddings."""

    def __init__(self):
        self.sum_u = None
        self.sum_v = None
        self.sum_diag = 0.0
        self.n = 0

    def add(self, u: torch.Tensor, v: torch.Tensor) -> None:
        u, v = u.double().cpu(), v.double().cpu()
        su, sv = u.sum(0).numpy(), v.sum(0).numpy()
        self.sum_u = su if self.sum_u is None else self.sum_u + su
        self.sum_v = sv if self.sum_v is None else self.sum_v + sv
        self.sum_diag += float((u * v).sum())
        self.n += len(u)

    def state(self) -> dict | None:
        if self.n == 0:
            return None
        return {"sum_u": self.sum_u.tolist(), "sum_v": self.sum_v.tolist(), "sum_diag": self.sum_diag, "n": self.n}


def shuffled_beta(states: list[dict | None]) -> BetaEstimate:
    states = [s for s in states if s]
    n = sum(s["n"] for s in states)
    if n < 2:
        raise ValueError("shuffled beta needs at least two scored pairs")
    su = np.sum([s["sum_u"] for s in states], axis=0)
    sv = np.sum([s["sum_v"] for s in states], axis=0)
    diag = sum(s["sum_diag"] for s in states)
    return BetaEstimate("shuffled", float((su @ sv - diag) / (n * (n - 1))), None, n)


BETA_GIVEN = "given by the user (--beta)"


def check_beta_mode(mode: str, beta: float | None, supported: tuple[str, ...] = BETA_MODES, hint: str = "") -> None:
    """Refuse a beta that cannot be had, before anything is written (scoring and online training)."""
    if mode not in BETA_MODES:
        raise UserError(f"unknown beta mode {mode!r}; choose one of {', '.join(BETA_MODES)}")
    if mode == "fixed" and beta is None:
        raise ConfigError("beta_mode fixed needs beta set to a value", "beta_mode", "beta")
    if mode not in supported:
        raise UserError(hint or f"beta mode {mode} is not available here; choose one of {', '.join(supported)}")


def resolve_beta(mode: str, beta: float | None, random_inputs: Callable[[], tuple[BetaEstimate, str]]
                 ) -> tuple[BetaEstimate | None, str]:
    """beta before scoring and a sentence saying where it came from; None for shuffled, which is
    known only once every pair is scored. The one place the beta modes are told apart."""
    if mode == "fixed":
        return BetaEstimate("fixed", float(beta), None, None), BETA_GIVEN
    if mode == "shuffled":
        return None, "mean cosine of shuffled in-dataset pairs (a diagnostic: it sits inside the noisy distribution)"
    return random_inputs()


def cache_dir() -> Path:
    """$PAIRCLEAN_CACHE_DIR, else $XDG_CACHE_HOME/pairclean, else ~/.cache/pairclean."""
    if os.environ.get("PAIRCLEAN_CACHE_DIR"):
        return Path(os.environ["PAIRCLEAN_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pairclean"


def weights_fingerprint(module: torch.nn.Module) -> str:
    """sha1 over every tensor of the state dict (names, dtypes, shapes, bytes): the weights
    themselves, whatever tag, file or seed they came from."""
    digest = hashlib.sha1()
    for name, tensor in module.state_dict().items():
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class BetaCache:
    """random-inputs beta depends on the estimator, K, the seed and the batching, never on the
    data: computed once per (weights, provenance, K, seed, batch) and reused by later runs.

    The weights are identified by `weights_id` when the caller built the estimator itself from
    a complete description (provenance + seed + library versions: a checkpoint is named by its
    sha256, random init by its seed), else by hashing every weight; only estimators holding
    their weights as a torch module (`estimator.model`) are cached.
    """

    def __init__(self, directory: Path | None = None):
        self.dir = Path(directory) if directory is not None else cache_dir() / "beta"

    def key(self, estimator, left: str, right: str, k: int, seed: int, batch_size: int,
            weights_id: str | None = None) -> str | None:
        model = getattr(estimator, "model", None)
        if not isinstance(model, torch.nn.Module):
            return None
        provenance = {**estimator.provenance(), "device": estimator.device.type}
        if provenance.get("checkpoint_sha256"):  # the file's hash names the weights; its path may be relative
            provenance.pop("pretrained", None)
        weights = weights_id if weights_id is not None else weights_fingerprint(model)
        ident = {"provenance": provenance, "weights": weights, "left": left, "right": right,
                 "k": k, "seed": seed, "batch_size": batch_size, "torch": torch.__version__}
        return hashlib.sha1(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()

    def get(self, key: str) -> BetaEstimate | None:
        try:
            return BetaEstimate(**json.loads((self.dir / f"{key}.json").read_text()))
        except (OSError, ValueError, TypeError):
            return None  # absent or unreadable: computed again

    def put(self, key: str, beta: BetaEstimate) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            write_json(self.dir / f"{key}.json", beta.as_dict())
        except OSError:
            pass  # a read-only home only costs the next run the computation


def cached_random_input_beta(estimator, left: str, right: str, k: int, seed: int, batch_size: int,
                             cache: BetaCache | None, weights_id: str | None = None) -> tuple[BetaEstimate, bool]:
    """(beta, whether it came from the cache)."""
    key = cache.key(estimator, left, right, k, seed, batch_size, weights_id) if cache is not None else None
    if key is not None:
        hit = cache.get(key)
        if hit is not None:
            return hit, True
    beta = random_input_beta(estimator, left, right, k=k, seed=seed, batch_size=batch_size)
    if key is not None:
        cache.put(key, beta)
    return beta, False
