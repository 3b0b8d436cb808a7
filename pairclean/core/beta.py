"""The cone bias beta (OSA Eq. 4): the mean cosine of random pairs through the same encoders.

`random-inputs` (default) pushes K random left inputs and K random right inputs (noise images,
random-token texts) through the estimator and averages all K x K cross cosines. The inputs are
drawn in blocks of DRAW_BLOCK, block b of a side from its own generator seeded by (seed, side, b),
and each block is encoded at once: what is drawn and how it is encoded depend on the seed and K
alone, never on the run's batch size, so beta is the same to the bit at any batch size (and its
cache needs no batch size). `shuffled` is
the mean cosine of in-dataset pairs with one side permuted, accumulated while scoring from
per-part embedding sums (it sits inside the noisy distribution: a diagnostic, not a boundary).
`fixed` takes the user's value.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch

from pairclean.config import COSINE, COSINE_STD, COUNT, check_choice, setting
from pairclean.errors import ConfigError
from pairclean.ops.progress import SILENT, Progress
from pairclean.ops.records import JsonObject

BETA_MODES = ("random-inputs", "shuffled", "fixed")
DRAW_BLOCK = 64  # random inputs per seeded block (see the module docstring)
RANDOM_INPUTS_VERSION = 2  # how the random inputs are drawn: 1 drew them batch by batch from one generator


@dataclass
class BetaEstimate:
    """The cone bias and how it was measured; read back (a resumed run's beta.json, the beta
    cache) by `ops.records.convert`, which holds each number to its declared range."""

    mode: str
    beta: float = setting(bounds=COSINE)
    std: float | None = setting(bounds=COSINE_STD)
    k: int | None = setting(bounds=COUNT)
    seed: int | None = None

    def as_dict(self) -> JsonObject:
        return asdict(self)


def block_generator(seed: int, side: int, block: int) -> torch.Generator:
    """The generator of one block of random inputs: seeded from (seed, side, block) alone."""
    state = np.random.SeedSequence([seed, side, block]).generate_state(1)[0]
    return torch.Generator().manual_seed(int(state))


@torch.no_grad()
def random_input_beta(estimator, left: str, right: str, k: int = 1024, seed: int = 0,
                      progress: Progress = SILENT) -> BetaEstimate:
    """beta = mean over all K x K cosines between K random left and K random right inputs
    (`progress`: a task counting the 2K inputs, block by block)."""
    sides = f"{left}s" if left == right else f"{left}s and {right}s"
    with progress.task(f"beta: random {sides}", total=2 * k) as task:

        def embed(side: int, modality: str) -> torch.Tensor:
            blocks = []
            for block, start in enumerate(range(0, k, DRAW_BLOCK)):
                n = min(DRAW_BLOCK, k - start)
                inputs = estimator.random_batch(modality, n, block_generator(seed, side, block))
                blocks.append(estimator.encode(modality, inputs).double().cpu())
                task.update(advance=n)
            return torch.cat(blocks)

        u = embed(0, left)
        v = embed(1, right)
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


BETA_GIVEN = "given by the user (beta)"


def check_beta_mode(mode: str, beta: float | None, supported: tuple[str, ...] = BETA_MODES,
                    hint: str | ConfigError = "") -> None:
    """Refuse a beta that cannot be had, before anything is written (scoring and online training).
    `hint`: the error (or its message) for a mode outside `supported`."""
    check_choice(mode, BETA_MODES, "beta_mode", "beta mode")
    if mode == "fixed" and beta is None:
        raise ConfigError("beta_mode fixed needs beta set to a value", "beta_mode", "beta")
    if mode not in supported:
        if isinstance(hint, ConfigError):
            raise hint
        raise ConfigError(hint or f"beta_mode {mode} is not available here; choose one of {', '.join(supported)}",
                          "beta_mode")


def resolve_beta(mode: str, beta: float | None, random_inputs: Callable[[], tuple[BetaEstimate, str]]
                 ) -> tuple[BetaEstimate | None, str]:
    """beta before scoring and a sentence saying where it came from; None for shuffled, which is
    known only once every pair is scored. The one place the beta modes are told apart."""
    if mode == "fixed":
        return BetaEstimate("fixed", float(beta), None, None), BETA_GIVEN
    if mode == "shuffled":
        return None, "mean cosine of shuffled in-dataset pairs (a diagnostic: it sits inside the noisy distribution)"
    return random_inputs()
