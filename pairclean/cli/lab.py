"""`pairclean corrupt` and `pairclean demo`: noise injection with ground truth, and the whole lab in one command."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

import pairclean.cli.options as options
from pairclean.cli.app import announce, app, console
from pairclean.cli.progress import RichProgress
from pairclean.cli.terminal import print_table
from pairclean.errors import UserError


@app.command("corrupt")
@options.dataset_options
def corrupt_command(
    ctx: typer.Context,
    source: options.Source,
    out: Path = typer.Option(..., "--out", "-o", help="Directory for the noisy copy, truth/truth.parquet and manifest.yaml."),
    ratio: float = typer.Option(..., help="Share of the pairs drawn for noise, in [0, 1]."),
    seed: int = typer.Option(0, help="Noise seed."),
    mode: str = typer.Option("shuffle", help="shuffle: permute the drawn captions (NCR); hard: the caption of the nearest other item "
                                             "(TF-IDF of its texts); weak: replace ~30% of their words; "
                                             "mixed: --ratio shuffled and --weak-ratio weakened, disjoint draws; "
                                             "duplicate: add a copy of the drawn pairs (--kinds) in new shards."),
    weak_ratio: Optional[float] = typer.Option(None, help="--mode mixed: share of the pairs weakened beside the --ratio shuffled."),
    kinds: Optional[str] = typer.Option(None, help="--mode duplicate: comma-separated exact, reencode, resize, crop, caption "
                                                   "(default: every kind that applies)."),
    other_captions: Optional[Path] = typer.Option(None, help="--mode duplicate: Parquet of (key, caption) rows, other captions of "
                                                             "the same items, for the caption kind."),
    overwrite: bool = typer.Option(False, help="Replace an existing output directory."),
) -> None:
    """Inject caption noise into a dataset, or plant duplicates (--mode duplicate); every other member stays byte-identical."""
    dataset = options.dataset_given(ctx)
    from pairclean.calibrate.corrupt import corrupt
    from pairclean.ops.guard import open_output

    target = open_output(out, source, "out", kind="directory", overwrite=overwrite)  # the run adds the files it reads
    data = dataset.open(source)
    announce(data)
    if mode == "duplicate":
        from pairclean.calibrate.duplicates import plant_duplicates

        result = plant_duplicates(data, target, ratio, seed=seed, overwrite=overwrite, other_captions=other_captions,
                                  kinds=tuple(k.strip() for k in kinds.split(",") if k.strip()) if kinds else None)
        console.print(f"{result.pairs:,} pair{'s' if result.pairs != 1 else ''} written to {result.out}: "
                      f"{result.selected:,} cop{'y' if result.selected == 1 else 'ies'} planted", soft_wrap=True)
    else:
        if kinds or other_captions:
            raise UserError("--kinds and --other-captions go with --mode duplicate")
        result = corrupt(data, target, ratio, seed=seed, mode=mode, overwrite=overwrite, weak_ratio=weak_ratio)
        unchanged = result.selected - result.noisy
        kept = f" ({unchanged:,} drawn pair kept its caption)" if unchanged == 1 else \
            f" ({unchanged:,} drawn pairs kept their caption)" if unchanged else ""
        console.print(f"{result.pairs:,} pair{'s' if result.pairs != 1 else ''} copied to {result.out}: "
                      f"{result.selected:,} drawn, {result.noisy:,} noisy{kept}", soft_wrap=True)
    console.print(f"truth: {result.truth}\nmanifest: {result.manifest}", soft_wrap=True)


PAPER_TABLE5 = "OSA paper (CLIP ViT-B/32 w/o DA, MS-COCO): clean kept / noise caught 93.88 / 97.49 at 20%, 93.91 / 99.35 at 50%"


def band_line(band: dict | None) -> str:
    """Whether the demo's figures are inside README's band (measured across machines)."""
    from pairclean.lab.demo import BAND_LABELS

    if band is None:
        return "README's band is for the default demo (2,000 pairs, 50% noise, seed 0, K 1024): not compared"
    outside = [f"{BAND_LABELS[name]} {value:.4g} (band {low:g} to {high:g})" for name, (value, low, high) in band.items()
               if value is None or not low <= value <= high]
    if not outside:
        return ("every figure is inside README's band (beta, beta's noise caught, GMM and oracle balanced accuracy, "
                "ROC-AUC, as measured across machines: docs/lab.md); this machine prints this table on every run")
    return (f"outside README's band (measured across machines, docs/lab.md): {'; '.join(outside)}. This machine's CPU "
            "arithmetic trained another estimator than those measured; it prints this table on every run")


@app.command("demo")
def demo_command(
    out: Path = typer.Option(Path("demo-output"), "--out", "-o", help="Directory for everything the demo writes. An "
                             "earlier demo's output there is replaced (it needs no --overwrite: the demo is meant to "
                             "be run again); any other directory that is not empty is refused."),
    pairs: int = typer.Option(2000, help="Evaluation pairs."),
    ratio: float = typer.Option(0.5, help="Share of the pairs whose captions are shuffled."),
    seed: int = typer.Option(0, help="Seed of the evaluation world and of the noise."),
    beta_k: int = typer.Option(1024, help="K random inputs per side for the cone bias beta."),
    retrain: bool = typer.Option(False, help="Train the estimator again even if a cached one exists."),
    workers: int = typer.Option(1, help="DataLoader workers."),
    device: str = typer.Option("auto", help="auto, cpu, cuda ..."),
) -> None:
    """Toy world -> tiny estimator (trained or cached) -> shuffle noise -> score -> detection table. Offline."""
    from pairclean.lab.numerics import pin_cpu_numerics

    pin_cpu_numerics()  # before torch starts: the same table on any x86-64 CPU (run_demo says when it could not)
    from pairclean.cli.evaluate import detection_tables
    from pairclean.cli.options import flag_for
    from pairclean.errors import ConfigError, UserError
    from pairclean.lab.demo import DemoConfig, run_demo

    try:
        cfg = DemoConfig(out=out, pairs=pairs, world_seed=seed, ratio=ratio, noise_seed=seed, beta_k=beta_k,
                         retrain=retrain, workers=workers, device=device, progress=RichProgress(console, prefix="demo"))
    except ConfigError as exc:  # --seed sets both seeds of the demo
        raise UserError(exc.worded(lambda f: "--seed" if f in ("world_seed", "noise_seed") else flag_for(f))) from None
    result = run_demo(cfg)
    for table in detection_tables(result.metrics):
        print_table(console, table)
    console.print(PAPER_TABLE5, soft_wrap=True)
    console.print(band_line(result.band), soft_wrap=True, highlight=False)
    stages = ", ".join(f"{k} {v:.0f}s" for k, v in result.seconds.items() if k != "total")
    console.print(f"done in {result.seconds['total']:.0f}s ({stages}; estimator "
                  f"{'from the cache' if result.estimator_cached else 'trained now'})", soft_wrap=True)
    for name, path in result.files.items():
        console.print(f"  {name:<10} {path}", soft_wrap=True, highlight=False)
    console.print(f"query: pairclean query {result.files['scores']} \"SELECT key, sim, p_clean, osa_noisy FROM scores "
                  f"ORDER BY sim LIMIT 10\"", soft_wrap=True, highlight=False)
