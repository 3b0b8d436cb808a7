"""`pairclean demo`: the whole lab in one command, offline.

Render a toy world, train (or reuse the cached) tiny estimator, shuffle the captions of a share
of the pairs, score the noisy copy through the normal scoring pipeline, and measure how well
the scores find the noise. Everything lands under one output directory:

    OUT/world/              the clean evaluation world (WebDataset shards + manifest.yaml)
    OUT/noisy/              its corrupted copy, with truth/truth.parquet and manifest.yaml
    OUT/estimator/          the training split, the trainer's run and estimator.pt (only when trained now)
    OUT/scores.parquet      per-pair scores (query with duckdb)
    OUT/detection.json      the metrics table
    OUT/demo.json           settings, stage timings, where every file is
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from pairclean.config import COUNT, SEED, SHARE, at_least, check_settings, pinned_settings, setting, unpinned
from pairclean.ops.atomic import write_json
from pairclean.ops.cache import cache_dir
from pairclean.ops.guard import open_output
from pairclean.ops.progress import SILENT, Progress
from pairclean.calibrate.corrupt import corrupt
from pairclean.lab.numerics import cpu_numerics, numerics_pinned, torch_threads
from pairclean.ops.notices import notice
from pairclean.errors import ConfigError
from pairclean.ops.records import Keyed
from pairclean.scorefile.evaluation import DetectionReport, evaluate_detection
from pairclean.scoring.model import ScoreConfig, score
from pairclean.lab.synth.estimator import LAB_DECODE, TOY_MODEL, EstimatorRecipe, cached_checkpoint, train_estimator
from pairclean.lab.synth.world import build_world

MARKER = "demo.json"
# README's band: the lowest and the highest each figure of the default demo's table took, as the
# table prints it, over the machines and CPU settings measured (docs/lab.md, "Across machines");
# tests/test_demo.py holds README to these numbers. A run here prints the same table every time;
# on another machine its own.
BAND = {"beta": (0.3981, 0.4957), "beta_caught": (66.47, 74.27), "gmm_balanced": (96.75, 97.50),
        "oracle_balanced": (96.80, 97.55), "roc_auc": (0.9902, 0.9921)}
BAND_DIGITS = {"beta": 4, "beta_caught": 2, "gmm_balanced": 2, "oracle_balanced": 2, "roc_auc": 4}  # as printed
BAND_LABELS = {"beta": "beta", "beta_caught": "beta's noise caught %", "gmm_balanced": "GMM balanced acc. %",
               "oracle_balanced": "oracle balanced acc. %", "roc_auc": "ROC-AUC"}


@dataclass
class DemoConfig:
    out: Path = Path("demo-output")
    pairs: int = setting(2000, at_least(2))  # evaluation pairs (OSA Table 11 ranks 2,000 samples)
    world_seed: int = setting(0, SEED)
    ratio: float = setting(0.5, SHARE)
    noise_seed: int = setting(0, SEED)
    recipe: EstimatorRecipe = field(default_factory=EstimatorRecipe)
    beta_k: int = setting(1024, COUNT)  # random inputs per side for the cone bias beta
    retrain: bool = False  # ignore the cached estimator
    cache_dir: Path | None = None
    workers: int = setting(1, at_least(0))
    device: str = "auto"
    progress: Progress = unpinned(SILENT)  # step notes and the training/scoring bars

    def __post_init__(self):
        check_settings(self)

    def default_table(self) -> bool:
        """Whether these settings make README's table (the band is measured for it alone)."""
        default = DemoConfig()
        return all(getattr(self, name) == getattr(default, name)
                   for name in ("pairs", "world_seed", "ratio", "noise_seed", "recipe", "beta_k"))


@dataclass
class DemoResult:
    out: Path
    checkpoint: Path
    estimator_cached: bool
    metrics: DetectionReport
    seconds: Keyed[str, float]  # per stage
    files: Keyed[str, Path]
    # figure -> (value, low, high) against README's band (`band_check`); None: other settings
    band: Keyed[str, tuple[float | None, float, float]] | None = None


def band_figures(metrics: DetectionReport) -> Keyed[str, float | None]:
    """The figures of the demo's table that README states a band for."""
    rules = metrics.rules
    return {"beta": rules["beta"].threshold, "beta_caught": rules["beta"].noise_caught,
            "gmm_balanced": rules["gmm"].balanced_accuracy, "oracle_balanced": rules["oracle"].balanced_accuracy,
            "roc_auc": metrics.roc_auc}


def band_check(figures: Keyed[str, float | None]) -> Keyed[str, tuple[float | None, float, float]]:
    """Each banded figure (`band_figures`) as the table prints it, with README's band: (value, low, high)."""
    return {name: (None if value is None else round(value, BAND_DIGITS[name]), *BAND[name])
            for name, value in figures.items()}


def _open_out(cfg: DemoConfig) -> Path:
    """The demo re-runs into its own directory, but never into someone else's, nor over the cache
    its estimator comes from."""
    out = open_output(cfg.out, [cfg.cache_dir or cache_dir()], "out", kind="directory", overwrite=None).path
    if out.exists() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise ConfigError(f"{out} exists, is not empty and is not a demo output: choose another `out`", "out")
    out.mkdir(exist_ok=True)
    return out


def run_demo(cfg: DemoConfig | None = None) -> DemoResult:
    cfg = cfg or DemoConfig()
    with torch_threads(cfg.recipe.threads):  # scoring too: the table is the same wherever the arithmetic is
        return _run_demo(cfg)


def _run_demo(cfg: DemoConfig) -> DemoResult:
    say = cfg.progress.note
    out = _open_out(cfg)
    if (out / MARKER).is_file():  # the one output replaced without `overwrite`: a rerun of the demo
        say(f"replacing the earlier demo output in {out} (the demo replaces its own output, and refuses any other "
            "directory that is not empty)")
    if not numerics_pinned():
        notice("the demo runs with this machine's own CPU arithmetic (torch started before it could be fixed, or "
               "the CPU has no AVX2): its figures may fall outside README's band")
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[stage] = round(now - clock, 2)
        clock = now

    checkpoint = None if cfg.retrain else cached_checkpoint(cfg.recipe, cfg.cache_dir)
    cached = checkpoint is not None
    if cached:
        say(f"reusing the cached estimator {checkpoint}")
    else:
        checkpoint = train_estimator(out / "estimator", cfg.recipe, workers=cfg.workers, device=cfg.device,
                                     overwrite=True, progress=cfg.progress, cache_dir=cfg.cache_dir)
    lap("estimator")

    say(f"rendering the evaluation world: {cfg.pairs:,} pairs (seed {cfg.world_seed}) -> {out / 'world'}")
    build_world(out / "world", cfg.pairs, seed=cfg.world_seed, overwrite=True)
    lap("world")

    say(f"shuffling the captions of {cfg.ratio:.0%} of the pairs (seed {cfg.noise_seed}) -> {out / 'noisy'}")
    noisy = corrupt(str(out / "world" / "manifest.yaml"), out / "noisy", cfg.ratio, seed=cfg.noise_seed,
                    mode="shuffle", overwrite=True)
    lap("corrupt")

    say(f"scoring with {TOY_MODEL} -> {out / 'scores.parquet'}")
    scores = out / "scores.parquet"
    score(str(noisy.manifest), scores, ScoreConfig(model=TOY_MODEL, pretrained=str(checkpoint), device=cfg.device,
                                                   workers=cfg.workers, beta_k=cfg.beta_k, seed=cfg.noise_seed,
                                                   decode=LAB_DECODE, overwrite=True, progress=cfg.progress))
    lap("score")

    metrics = evaluate_detection(scores, noisy.manifest)
    write_json(out / "detection.json", metrics.to_json())
    lap("evaluate")
    seconds["total"] = round(sum(seconds.values()), 2)

    files = {"world": out / "world", "noisy": out / "noisy", "truth": noisy.truth, "scores": scores,
             "detection": out / "detection.json", "checkpoint": checkpoint, "summary": out / MARKER}
    write_json(out / MARKER, {"settings": {**pinned_settings(cfg), "out": str(out)}, "cpu": cpu_numerics(),
                              "estimator_cached": cached,
                              "seconds": seconds, "files": {k: str(v) for k, v in files.items()},
                              "corrupt": noisy.as_dict()})
    return DemoResult(out, checkpoint, cached, metrics, seconds, files,
                      band_check(band_figures(metrics)) if cfg.default_table() else None)
