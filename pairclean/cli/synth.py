"""`pairclean synth ...`: lab datasets (toy world, COCO-mini) and the toy world's estimator."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from pairclean.cli.app import App, app, console
from pairclean.cli.progress import RichProgress

synth_app = App(no_args_is_help=True, help="Build lab datasets with known ground truth, and the toy estimator.")
app.add_typer(synth_app, name="synth")


@synth_app.command("toy-world")
def toy_world_command(
    out: Path = typer.Option(..., "--out", "-o", help="Directory for the shards and manifest.yaml."),
    pairs: int = typer.Option(2000, help="Number of image-caption pairs."),
    seed: int = typer.Option(0, help="World seed: pair i depends only on (seed, i)."),
    shard_size: int = typer.Option(1000, help="Pairs per tar shard."),
    captions_per_scene: int = typer.Option(1, help="Captions per scene, one pair each (MS-COCO has 5); "
                                                   "--pairs must be a multiple."),
    other_captions: int = typer.Option(0, help="Also write this many other wordings of each caption to captions/other-captions.parquet "
                                               "(for corrupt --mode duplicate's caption kind)."),
    overwrite: bool = typer.Option(False, help="Replace an existing directory."),
) -> None:
    """Render coloured shapes (1-3 objects, colour, shape, size, layout) with captions that describe them."""
    from pairclean.lab.synth.world import build_world

    spec = build_world(out, pairs, seed=seed, shard_size=shard_size, overwrite=overwrite,
                       captions_per_scene=captions_per_scene, other_captions=other_captions)
    console.print(f"{pairs:,} pairs in {len(spec.shards)} shard(s) under {out}; manifest {out / 'manifest.yaml'}")


@synth_app.command("coco-mini")
def coco_mini_command(
    src: Path = typer.Option(..., "--src", help="shared/data/coco-mini (pairs.jsonl + images)."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory (shards) or .parquet file to write."),
    parquet: bool = typer.Option(False, help="Write one Parquet file (image bytes column) instead of shards."),
    all_captions: bool = typer.Option(False, help="One pair per caption instead of per image."),
    limit: Optional[int] = typer.Option(None, help="At most this many pairs."),
    shard_size: int = typer.Option(100, help="Pairs per tar shard."),
    overwrite: bool = typer.Option(False, help="Replace an existing output."),
) -> None:
    """Real COCO JPEGs with their human captions, as WebDataset shards or Parquet."""
    from pairclean.lab.coco import build_parquet, build_shards

    if parquet:
        build_parquet(src, out, all_captions=all_captions, limit=limit, overwrite=overwrite)
        console.print(f"wrote {out}")
    else:
        spec = build_shards(src, out, shard_size=shard_size, all_captions=all_captions, limit=limit, overwrite=overwrite)
        console.print(f"{len(spec.shards)} shard(s) under {out}; manifest {out / 'manifest.yaml'}")


@synth_app.command("web-shards")
def web_shards_command(
    src: Path = typer.Option(..., "--src", help="shared/data/coco-mini (pairs.jsonl + images)."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory for the shards and manifest.yaml."),
    shards: int = typer.Option(2, help="Number of tar shards."),
    pairs_per_shard: int = typer.Option(5000, help="Pairs per shard (img2dataset writes 5,000-10,000)."),
    seed: int = typer.Option(0, help="Pair i depends only on (seed, i)."),
    jobs: int = typer.Option(1, help="Processes rendering the pairs (the shards are the same for any number)."),
    progressive: float = typer.Option(0.0, help="Share of the JPEGs written progressive, 0-1 (web crawls hold some)."),
    bad_share: float = typer.Option(0.0, help="Share of the images stored as a web crawl's other files, 0-1: truncated "
                                    "JPEGs, PNG, WebP, CMYK, progressive and greyscale JPEGs, empty files, headers "
                                    "declaring 65,000 x 65,000 pixels (one kind each, drawn from the seed)."),
    overwrite: bool = typer.Option(False, help="Replace an existing directory."),
) -> None:
    """Web-style shards for throughput: COCO-mini images cropped, resized to 256-384 px and re-encoded."""
    from pairclean.lab.coco import build_web_shards

    spec = build_web_shards(src, out, shards=shards, pairs_per_shard=pairs_per_shard, seed=seed, overwrite=overwrite,
                            jobs=jobs, progressive=progressive, bad_share=bad_share)
    console.print(f"{shards * pairs_per_shard:,} pairs in {len(spec.shards)} shard(s) under {out}; "
                  f"manifest {out / 'manifest.yaml'}")


@synth_app.command("train-estimator")
def train_estimator_command(
    out: Path = typer.Option(..., "--out", "-o", help="Directory for the training world, the run and estimator.pt."),
    world: Optional[Path] = typer.Option(None, help="Train on this clean toy world instead of rendering one."),
    pairs: int = typer.Option(8000, help="Clean training pairs to render."),
    world_seed: int = typer.Option(1, help="Seed of the training world (evaluate on another seed)."),
    epochs: int = typer.Option(6, help="Training epochs."),
    batch_size: int = typer.Option(256, help="Pairs per step (in-batch negatives)."),
    lr: float = typer.Option(3e-3, help="Peak learning rate (AdamW, warm-up then cosine). 3e-3 is tuned to "
                             "the demo's world (seed 1); for other --world-seed values use 1e-3 (docs/lab.md)."),
    temperature: float = typer.Option(0.02, help="Fixed softmax temperature of the InfoNCE loss."),
    seed: int = typer.Option(0, help="Training seed (initialisation and data order)."),
    workers: int = typer.Option(1, help="DataLoader workers decoding the PNGs."),
    device: str = typer.Option("auto", help="auto, cpu, cuda ..."),
    overwrite: bool = typer.Option(False, help="Replace an existing directory."),
) -> None:
    """Train the tiny CLIP-style `pairclean-toy` estimator on clean toy-world pairs (pairclean's trainer)."""
    from pairclean.lab.numerics import pin_cpu_numerics

    pin_cpu_numerics()  # before torch starts: the demo's weights on any x86-64 CPU
    from pairclean.lab.synth.estimator import (
        TOY_MODEL,
        EstimatorRecipe,
        train_estimator,
    )

    recipe = EstimatorRecipe(pairs=pairs, world_seed=world_seed, epochs=epochs, batch_size=batch_size, lr=lr,
                             temperature=temperature, seed=seed)
    checkpoint = train_estimator(out, recipe, world=world, workers=workers, device=device, overwrite=overwrite,
                                 progress=RichProgress(console))
    console.print(f"estimator: {checkpoint}\nscore with: pairclean score DATA --model {TOY_MODEL} --pretrained {checkpoint}")


@synth_app.command("coco-text")
def coco_text_command(
    src: Path = typer.Option(..., "--src", help="captions_val2017.json (or the directory holding it)."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory for the shards (or Parquet file) and manifest.yaml."),
    parquet: bool = typer.Option(False, help="One Parquet file (caption, caption2 columns) instead of tar shards."),
    limit: Optional[int] = typer.Option(None, help="First N images only."),
    shard_size: int = typer.Option(1000, help="Pairs per tar shard (rows per Parquet row group)."),
    overwrite: bool = typer.Option(False, help="Replace an existing directory."),
) -> None:
    """COCO captions as text-text pairs: one per image, (first caption, second caption) = clean."""
    from pairclean.lab.coco_text import build_text_pairs

    spec = build_text_pairs(src, out, format="parquet" if parquet else "webdataset", shard_size=shard_size,
                            limit=limit, overwrite=overwrite)
    console.print(f"text-text pairs in {len(spec.shards)} file(s) under {out}; manifest {out / 'manifest.yaml'}",
                  soft_wrap=True)


@synth_app.command("toy-pairs")
def toy_pairs_command(
    kind: str = typer.Argument(..., help="image-label (one shape per image, label = its name) or image-image "
                                         "(two views of one scene)."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory for the shards, manifest.yaml and truth/."),
    pairs: int = typer.Option(1000, help="Number of pairs."),
    noise: float = typer.Option(0.0, help="Share of the pairs whose labels / second images are permuted (truth written)."),
    seed: int = typer.Option(0, help="World and noise seed."),
    shard_size: int = typer.Option(1000, help="Pairs per tar shard."),
    label: str = typer.Option("shape", help="image-label: the object's shape name or its colour name."),
    overwrite: bool = typer.Option(False, help="Replace an existing directory."),
) -> None:
    """Toy-world pairs of the kinds without captions, with known mismatches."""
    from pairclean.lab.toy_pairs import build_toy_pairs

    spec = build_toy_pairs(out, kind, pairs, seed=seed, noise=noise, shard_size=shard_size, label=label,
                           overwrite=overwrite)
    console.print(f"{pairs:,} {kind} pairs in {len(spec.shards)} shard(s) under {out}; manifest {out / 'manifest.yaml'}"
                  + (f"; truth {spec.truth}" if spec.truth else ""), soft_wrap=True)
