"""The toy world's estimator: the `pairclean-toy` open_clip config trained from random init on a
clean toy-world split with pairclean's own trainer (`pairclean.train`, plain symmetric InfoNCE).

The result is a plain state_dict that loads through the normal open_clip path,
`open_clip.create_model_and_transforms("pairclean-toy", pretrained=PATH, weights_only=True)`,
so `pairclean score --model pairclean-toy --pretrained PATH` scores with it like with any CLIP.
A recipe's checkpoint is cached under a key made of everything that decides its weights.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pairclean import __version__
from pairclean.ops.atomic import atomic_path, write_json
from pairclean.ops.progress import SILENT, Progress
from pairclean.ops.cache import cache_dir as pairclean_cache_dir
from pairclean.ops.guard import open_output
from pairclean.config import COUNT, SEED, above, at_least, check_settings, declare, setting
from pairclean.errors import ConfigError
from pairclean.backends.open_clip import CONFIG_DIR
from pairclean.lab.numerics import cpu_numerics, torch_threads
from pairclean.lab.synth.world import WORLD_VERSION, build_world

TOY_MODEL = "pairclean-toy"
# The lab decodes and resizes with PIL (`decode` exact): integer arithmetic alike on every CPU, as
# the estimator's and the demo's were before `fast` resized with torch (whose kernel follows the CPU's
# instruction set), so their documented figures and the cached estimators stay what they were.
LAB_DECODE = "exact"
CHECKPOINT = "estimator.pt"
RECORD = "estimator.json"


@dataclass
class EstimatorRecipe:
    """Everything that decides the trained weights (the training split is rebuilt from it)."""

    pairs: int = setting(8000, COUNT)  # clean training pairs
    world_seed: int = setting(1, SEED)  # the training split; the demo evaluates on the world of seed 0
    epochs: int = setting(6, COUNT)
    batch_size: int = setting(256, at_least(2))
    lr: float = setting(3e-3, above(0))
    weight_decay: float = setting(0.1, at_least(0))
    warmup_steps: int = setting(30, at_least(0))
    temperature: float | None = setting(0.02, above(0))  # fixed, CLIP-like sharpness; None: learned from 0.07 (ends near 0.06)
    seed: int = setting(0, SEED)
    threads: int = setting(2, at_least(1))  # torch's intra-op threads while training: their number changes the weights (lab/numerics.py)

    def __post_init__(self):
        check_settings(self)

    def check(self) -> None:
        """What concerns several fields: the training split fills at least one batch."""
        if self.pairs < self.batch_size:
            raise ConfigError(f"pairs ({self.pairs}) must be at least batch_size ({self.batch_size})", "pairs", "batch_size")

    def cache_key(self) -> str:
        """Recipe + model config + world version + pairclean version + this process's CPU arithmetic
        (`numerics.cpu_numerics`): a change to any retrains."""
        config = (CONFIG_DIR / f"{TOY_MODEL}.json").read_text()
        blob = json.dumps({"recipe": asdict(self), "config": config, "world": WORLD_VERSION, "pairclean": __version__,
                           "cpu": cpu_numerics()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cached_checkpoint(recipe: EstimatorRecipe, cache_dir: Path | None = None) -> Path | None:
    """The cached checkpoint of this recipe, if one was trained before."""
    path = (cache_dir or pairclean_cache_dir()) / "toy-estimator" / recipe.cache_key() / CHECKPOINT
    return path if path.is_file() else None


@declare(workers=at_least(0))
def train_estimator(out: Path, recipe: EstimatorRecipe | None = None, world: Path | None = None, workers: int = 1,
                    device: str = "auto", overwrite: bool = False, progress: Progress = SILENT,
                    cache_dir: Path | None = None) -> Path:
    """Train the toy estimator into `out` (world/, run/, estimator.pt, estimator.json) and return
    the checkpoint; also store it in the cache (unless `world` is a user's own split, which the
    recipe does not describe)."""
    from pairclean.training import TrainConfig, train

    recipe = recipe or EstimatorRecipe()
    recipe.check()
    out = open_output(out, [world], "out", kind="directory", overwrite=overwrite).path  # filled piece by piece
    out.mkdir(exist_ok=True)
    started = time.perf_counter()
    if world is None:
        world = out / "world"
        progress.note(f"rendering {recipe.pairs:,} clean training pairs (seed {recipe.world_seed}) -> {world}")
        build_world(world, recipe.pairs, seed=recipe.world_seed, overwrite=True)
    world_seconds = time.perf_counter() - started
    config = TrainConfig(model=TOY_MODEL, pretrained="none", backend="open_clip", device=device,
                         epochs=recipe.epochs, batch_size=recipe.batch_size, lr=recipe.lr,
                         weight_decay=recipe.weight_decay, warmup_steps=recipe.warmup_steps,
                         temperature=recipe.temperature, seed=recipe.seed, decode=LAB_DECODE,
                         workers=workers, diagnostics=False, overwrite=True, progress=progress)
    progress.note(f"training {TOY_MODEL} for {recipe.epochs} epochs (batch {recipe.batch_size}) -> {out / 'run'}")
    manifest = world / "manifest.yaml"
    with torch_threads(recipe.threads):
        result = train(str(manifest) if manifest.is_file() else str(world), out / "run", config)
    checkpoint = out / CHECKPOINT
    with atomic_path(checkpoint) as tmp:
        shutil.copyfile(result.last_model, tmp)
    record = {"model": TOY_MODEL, "checkpoint": str(checkpoint), "recipe": asdict(recipe),
              "training_world": str(world), "cache_key": recipe.cache_key(), "cpu": cpu_numerics(),
              "world_seconds": world_seconds,
              "train_seconds": result.seconds, "epochs": [{k: e.get(k) for k in ("epoch", "train_loss", "seconds")}
                                                           for e in result.epochs],
              "score_with": f"pairclean score DATA --model {TOY_MODEL} --pretrained {checkpoint}"}
    write_json(out / RECORD, record)
    if world == out / "world":
        _store_in_cache(checkpoint, record, recipe, cache_dir)
    return checkpoint


def _store_in_cache(checkpoint: Path, record: dict, recipe: EstimatorRecipe, cache_dir: Path | None) -> Path:
    entry = (cache_dir or pairclean_cache_dir()) / "toy-estimator" / recipe.cache_key()
    entry.mkdir(parents=True, exist_ok=True)
    with atomic_path(entry / CHECKPOINT) as tmp:
        shutil.copyfile(checkpoint, tmp)
    write_json(entry / RECORD, record)
    return entry / CHECKPOINT
