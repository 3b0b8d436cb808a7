"""Toy-world image-label and image-image pairs, with known mismatches, for the non-caption pair kinds.

`pairclean corrupt` replaces captions, so the pair kinds without one get their ground truth from
the generator instead: a share `noise` of the pairs is drawn (seeded) and their labels, or second
images, are permuted among themselves; a pair that drew content equal to its own stays clean.

image-label: scene i of the toy world keeps only its first object, so the image shows one shape
and its label is that shape's name ("circle", ...) or, with `label="colour"`, its colour name;
scored with the label template it becomes "This is a picture of circle.".
image-image: scene i rendered twice: the same objects in the same cells, the second time on the
background, object jitter and tints of another scene (a second view of the same content).

The truth Parquet (key, shard, index, noisy, selected) is what `pairclean evaluate detection`
joins on, as for `corrupt`'s truth.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pairclean.ops.atomic import atomic_path
from pairclean.config import COUNT, SEED, at_least, check_choice, declare, within
from pairclean.data.manifest import write_manifest
from pairclean.data.spec import DatasetSpec, Fields
from pairclean.data.writer import write_shards
from pairclean.ops.guard import open_output
from pairclean.lab.synth.world import Scene, png_bytes, render, sample_scene

KINDS = ("image-label", "image-image")
LABELS = ("shape", "colour")  # which attribute of the object names an image-label pair's class
TRUTH_NAME = "truth/truth.parquet"
VIEW_SEED_OFFSET = 1_000_003  # second views borrow the look of scene i of world seed + this


def single_object(scene: Scene) -> Scene:
    """The scene with its first object only: one shape per image, so one label."""
    return replace(scene, objects=scene.objects[:1], jitter=scene.jitter[:1], tint=scene.tint[:1])


def second_view(scene: Scene, seed: int, index: int) -> Scene:
    """The same objects in the same cells under another scene's background, jitter and tints."""
    look = sample_scene(seed + VIEW_SEED_OFFSET, index)
    n = len(scene.objects)
    jitter = (look.jitter * n)[:n]
    tint = (look.tint * n)[:n]
    return replace(scene, background=look.background, jitter=jitter, tint=tint)


@declare(noise=within(0, 1, high_open=True))
def noise_plan(n: int, noise: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(donor of each pair's second side, selected mask): a seeded share permuted among itself."""
    rng = np.random.default_rng([seed, 4])
    chosen = np.sort(rng.choice(n, size=round(noise * n), replace=False))
    donor = np.arange(n)
    donor[chosen] = chosen[rng.permutation(len(chosen))]
    selected = np.zeros(n, dtype=bool)
    selected[chosen] = True
    return donor, selected


@declare(pairs=at_least(2), seed=SEED, noise=within(0, 1, high_open=True), shard_size=COUNT)
def build_toy_pairs(out: str | Path, kind: str, pairs: int, seed: int = 0, noise: float = 0.0,
                    shard_size: int = 1000, label: str = "shape", overwrite: bool = False) -> DatasetSpec:
    """Write `pairs` toy pairs of `kind` as WebDataset shards + manifest.yaml (+ truth when noise > 0)."""
    check_choice(kind, KINDS, "kind", "toy pair kind")
    check_choice(label, LABELS, "label", "label attribute")
    target = open_output(out, (), "out", kind="directory", overwrite=overwrite)
    out = target.path.resolve()  # the truth's shard column must match the scores' (absolute) shard paths
    donor, selected = noise_plan(pairs, noise, seed)
    scenes = [sample_scene(seed, i) for i in range(pairs)]
    if kind == "image-label":
        scenes = [single_object(s) for s in scenes]
        right = [getattr(s.objects[0], label) for s in scenes]
    else:
        right = [png_bytes(render(second_view(s, seed, i))) for i, s in enumerate(scenes)]
    seconds = [right[d] for d in donor]
    noisy = np.array([a != b for a, b in zip(right, seconds)])
    keys = [f"toy-{seed}-{i:07d}" for i in range(pairs)]
    member = "cls" if kind == "image-label" else "png2"

    def samples():
        for i, scene in enumerate(scenes):
            yield {"__key__": keys[i], "png": png_bytes(render(scene)), member: seconds[i]}

    with target.stage() as tmp:
        written = write_shards(samples(), tmp, prefix="toy", maxcount=shard_size)
        shards = [str(out / p.name) for p in written]
        truth = None
        if noise > 0:
            (tmp / "truth").mkdir()
            shard_of = np.repeat(np.arange(len(shards)), shard_size)[:pairs]
            with atomic_path(tmp / TRUTH_NAME) as path:
                pq.write_table(pa.table({"key": keys, "shard": [shards[s] for s in shard_of],
                                         "index": np.arange(pairs) % shard_size, "noisy": noisy,
                                         "selected": selected}), path)
            truth = str(out / TRUTH_NAME)
        spec = DatasetSpec(format="webdataset", shards=shards, pair=kind, fields=Fields(image="png", image2="png2"),
                           truth=truth, name=f"toy-{kind}-seed{seed}" + (f"-{label}" if kind == "image-label" else "")
                           + (f"-noise{noise:g}" if noise else ""))
        write_manifest(tmp / "manifest.yaml", spec, shards_relative_to=out)
    return spec
