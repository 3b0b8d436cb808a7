"""The random-inputs beta, computed once per estimator and reused by later runs (a JSON file per key).

beta from random inputs depends on the estimator's weights, K, the seed and how the inputs are
drawn and encoded (`core.beta.RANDOM_INPUTS_VERSION`), never on the data nor the run's batch size:
`BetaCache` names an entry by all of them, `cached_random_input_beta` reads it or computes it
(`core.beta.random_input_beta`, saying what it does, how to make it shorter, and where it is kept)
and stores it. The files live under `ops.cache.cache_dir()/beta`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from pairclean.core.beta import RANDOM_INPUTS_VERSION, BetaEstimate, random_input_beta
from pairclean.ops.atomic import write_json
from pairclean.ops.records import convert
from pairclean.ops.cache import cache_dir
from pairclean.ops.progress import SILENT, Progress


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
    """random-inputs beta depends on the estimator, K, the seed and the draw, never on the data
    nor the batch size: computed once per (weights, provenance, K, seed, draw) and reused by later
    runs. An entry computed with an earlier draw (another RANDOM_INPUTS_VERSION) is never served.

    The weights are identified by `weights_id` when the caller built the estimator itself from
    a complete description (provenance + seed + library versions: a checkpoint is named by its
    sha256, random init by its seed), else by hashing every weight; only estimators holding
    their weights as a torch module (`estimator.model`) are cached.
    """

    def __init__(self, directory: Path | None = None):
        self.dir = Path(directory) if directory is not None else cache_dir() / "beta"

    def key(self, estimator, left: str, right: str, k: int, seed: int, weights_id: str | None = None) -> str | None:
        model = getattr(estimator, "model", None)
        if not isinstance(model, torch.nn.Module):
            return None
        provenance = {**estimator.provenance(), "device": estimator.device.type}
        if provenance.get("checkpoint_sha256"):  # the file's hash names the weights; its path may be relative
            provenance.pop("pretrained", None)
        weights = weights_id if weights_id is not None else weights_fingerprint(model)
        ident = {"provenance": provenance, "weights": weights, "left": left, "right": right,
                 "k": k, "seed": seed, "draw": RANDOM_INPUTS_VERSION, "torch": torch.__version__}
        return hashlib.sha1(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()

    def get(self, key: str) -> BetaEstimate | None:
        try:
            return convert(json.loads((self.dir / f"{key}.json").read_text()), BetaEstimate)
        except (OSError, ValueError, TypeError):
            return None  # absent or unreadable: computed again

    def put(self, key: str, beta: BetaEstimate) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            write_json(self.dir / f"{key}.json", beta.as_dict())
        except OSError:
            pass  # a read-only home only costs the next run the computation


def cached_random_input_beta(estimator, left: str, right: str, k: int, seed: int, cache: BetaCache | None,
                             weights_id: str | None = None, progress: Progress = SILENT) -> tuple[BetaEstimate, bool]:
    """(beta, whether it came from the cache). Computing it says first what it does and what
    makes it shorter, since on a CPU it takes minutes."""
    key = cache.key(estimator, left, right, k, seed, weights_id) if cache is not None else None
    if key is not None:
        hit = cache.get(key)
        if hit is not None:
            return hit, True
    kept = f"kept in {cache.dir} for later runs of these weights, K and seed" if key is not None else "not cached"
    progress.note(f"beta: {2 * k:,} random inputs through the model, once ({kept}); shorter: `beta_k` "
                  f"{max(k // 4, 1)}, or `beta_mode` shuffled (no extra inputs)", "beta_k", "beta_mode")
    beta = random_input_beta(estimator, left, right, k=k, seed=seed, progress=progress)
    if key is not None:
        cache.put(key, beta)
    return beta, False
