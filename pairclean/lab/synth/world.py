"""The toy world: images of coloured shapes with captions that describe them.

Every scene has one to three objects (colour x shape x size) placed in distinct cells of a
3 x 3 grid on a muted, sometimes graded background. Captions name every object's size, colour
and shape and the layout: one object gets its location ("in the top left"), two objects a
relation ("above and to the left of"), a third object its location. A contrastive model has to
bind colour to shape and read positions to tell two scenes apart.

Scene i depends only on (seed, i), so a world is the same however it is sharded. Like MS-COCO, a
world can give each scene several captions (`captions_per_scene`): the same facts in other words
(another object order, with the relations turned round, and another opening), one pair each.
"""

from __future__ import annotations

import io
import itertools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

from pairclean.config import COUNT, SEED, at_least, declare
from pairclean.errors import ConfigError
from pairclean.data.manifest import write_manifest
from pairclean.data.spec import DatasetSpec, Fields
from pairclean.data.writer import write_shards
from pairclean.ops.guard import open_output
from pairclean.ops.records import JsonObject

WORLD_VERSION = 1  # bump when rendering or captions change: cached estimators are then retrained
IMAGE_SIZE = 64
SUPERSAMPLE = 4  # drawn at 4x and box-filtered down: anti-aliased edges
GRID = 3
COLOURS = {
    "red": (215, 40, 40), "green": (40, 165, 60), "blue": (45, 85, 225),
    "yellow": (235, 205, 35), "purple": (145, 60, 195), "orange": (245, 135, 25),
}
SHAPES = ("circle", "square", "triangle", "diamond", "cross", "star")
SIZES = {"small": 0.22, "large": 0.40}  # radius as a share of a grid cell's side
LOCATIONS = {
    (0, 0): "in the top left", (0, 1): "at the top", (0, 2): "in the top right",
    (1, 0): "on the left", (1, 1): "in the middle", (1, 2): "on the right",
    (2, 0): "in the bottom left", (2, 1): "at the bottom", (2, 2): "in the bottom right",
}
PREFIXES = ("", "a picture of ", "an image of ", "there is ", "a drawing of ")
COLOUR_JITTER = 18  # per channel, so colours are categories, not single RGB values


@dataclass
class ToyObject:
    colour: str
    shape: str
    size: str
    row: int
    col: int

    def phrase(self) -> str:
        return f"a {self.size} {self.colour} {self.shape}"


@dataclass
class Scene:
    objects: list[ToyObject]
    background: tuple[tuple[int, int, int], tuple[int, int, int]]  # top / bottom colour of a vertical gradient
    prefix: str
    jitter: list[tuple[int, int]]  # per-object centre offset in pixels (final resolution)
    tint: list[tuple[int, int, int]]  # per-object colour jitter

    def caption(self) -> str:
        return self.prefix + describe(self.objects)

    def captions(self, n: int, seed: int, index: int) -> list[str]:
        """`n` captions of this scene: its own `caption()` first, then other (object order, prefix)
        wordings in a seeded order, distinct while there are enough (a one-object scene has
        five: one per prefix), repeating after that."""
        own = (tuple(range(len(self.objects))), self.prefix)
        others = [(order, prefix) for order in itertools.permutations(range(len(self.objects)))
                  for prefix in PREFIXES if (order, prefix) != own]
        np.random.default_rng([seed, index, 1]).shuffle(others)
        variants = [own] + others
        chosen = (variants[j % len(variants)] for j in range(n))
        return [prefix + describe([self.objects[k] for k in order]) for order, prefix in chosen]

    def as_dict(self) -> JsonObject:
        return {"objects": [asdict(o) for o in self.objects]}


def relation(a: ToyObject, b: ToyObject) -> str:
    """Where `a` is relative to `b` (rows grow downwards)."""
    vertical = "above" if a.row < b.row else "below" if a.row > b.row else ""
    horizontal = "to the left of" if a.col < b.col else "to the right of" if a.col > b.col else ""
    if vertical and horizontal:
        return f"{vertical} and {horizontal}"
    return vertical or horizontal


def describe(objects: list[ToyObject]) -> str:
    first = objects[0]
    if len(objects) == 1:
        return f"{first.phrase()} {LOCATIONS[(first.row, first.col)]}"
    text = f"{first.phrase()} {relation(first, objects[1])} {objects[1].phrase()}"
    if len(objects) == 3:
        third = objects[2]
        text += f", and {third.phrase()} {LOCATIONS[(third.row, third.col)]}"
    return text


def _byte(value: float) -> int:
    return int(min(max(value, 0), 255))


def _muted(rng: np.random.Generator) -> tuple[int, int, int]:
    """A low-saturation background colour: a grey level plus a small tint."""
    grey = rng.uniform(25, 230)
    tint = rng.uniform(-22, 22, size=3)
    return tuple(_byte(grey + t) for t in tint)


def sample_scene(seed: int, index: int) -> Scene:
    """Scene `index` of the world `seed` (independent of every other scene)."""
    rng = np.random.default_rng([seed, index])
    n = int(rng.integers(1, 4))
    cells = rng.choice(GRID * GRID, size=n, replace=False)
    objects = [ToyObject(colour=str(rng.choice(list(COLOURS))), shape=str(rng.choice(SHAPES)),
                         size=str(rng.choice(list(SIZES))), row=int(c) // GRID, col=int(c) % GRID) for c in cells]
    top = _muted(rng)
    bottom = top if rng.random() < 0.5 else _muted(rng)
    prefix = str(rng.choice(PREFIXES))
    jitter = [tuple(int(v) for v in rng.integers(-2, 3, size=2)) for _ in objects]
    tint = [tuple(int(v) for v in rng.integers(-COLOUR_JITTER, COLOUR_JITTER + 1, size=3)) for _ in objects]
    return Scene(objects, (top, bottom), prefix, jitter, tint)


def _polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]] | None:
    if shape == "triangle":
        return [(cx, cy - r), (cx + r * 0.94, cy + r * 0.7), (cx - r * 0.94, cy + r * 0.7)]
    if shape == "diamond":
        return [(cx, cy - r), (cx + r * 0.75, cy), (cx, cy + r), (cx - r * 0.75, cy)]
    if shape == "cross":
        t = r * 0.36
        return [(cx - t, cy - r), (cx + t, cy - r), (cx + t, cy - t), (cx + r, cy - t), (cx + r, cy + t),
                (cx + t, cy + t), (cx + t, cy + r), (cx - t, cy + r), (cx - t, cy + t), (cx - r, cy + t),
                (cx - r, cy - t), (cx - t, cy - t)]
    if shape == "star":
        angles = np.pi / 2 + np.arange(10) * np.pi / 5
        radii = np.where(np.arange(10) % 2 == 0, r, r * 0.45)
        return [(cx + float(rad * np.cos(a)), cy - float(rad * np.sin(a))) for a, rad in zip(angles, radii)]
    return None


def render(scene: Scene, size: int = IMAGE_SIZE) -> Image.Image:
    big = size * SUPERSAMPLE
    top, bottom = (np.asarray(c, dtype=np.float32) for c in scene.background)
    ramp = np.linspace(0.0, 1.0, big, dtype=np.float32)[:, None, None]
    column = (top * (1 - ramp) + bottom * ramp).round().astype(np.uint8)  # (big, 1, 3)
    img = Image.fromarray(column, "RGB").resize((big, big), Image.NEAREST)
    draw = ImageDraw.Draw(img)
    cell = big / GRID
    for obj, (dx, dy), tint in zip(scene.objects, scene.jitter, scene.tint):
        cx = (obj.col + 0.5) * cell + dx * SUPERSAMPLE
        cy = (obj.row + 0.5) * cell + dy * SUPERSAMPLE
        r = SIZES[obj.size] * cell
        fill = tuple(_byte(c + t) for c, t in zip(COLOURS[obj.colour], tint))
        if obj.shape == "circle":
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
        elif obj.shape == "square":
            s = r * 0.85
            draw.rectangle([cx - s, cy - s, cx + s, cy + s], fill=fill)
        else:
            draw.polygon(_polygon(obj.shape, cx, cy, r), fill=fill)
    return img.reduce(SUPERSAMPLE)


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


def samples(seed: int, index: int, captions_per_scene: int = 1) -> list[dict]:
    """Scene `index`'s WebDataset samples, one per caption: png image, txt caption, json scene (the
    objects only: a corrupted copy must not carry the original caption in another member). With
    one caption the key is `toy-SEED-INDEX`, else `toy-SEED-INDEX-J`."""
    scene = sample_scene(seed, index)
    png, objects = png_bytes(render(scene)), json.dumps(scene.as_dict(), sort_keys=True)
    if captions_per_scene == 1:
        return [{"__key__": f"toy-{seed}-{index:07d}", "png": png, "txt": scene.caption(), "json": objects}]
    return [{"__key__": f"toy-{seed}-{index:07d}-{j}", "png": png, "txt": text, "json": objects}
            for j, text in enumerate(scene.captions(captions_per_scene, seed, index))]


OTHER_CAPTIONS = "captions/other-captions.parquet"  # under the world: what `corrupt --mode duplicate` draws from


def write_other_captions(path: Path, seed: int, scenes: int, n: int, batch: int = 65536) -> None:
    """(key, caption) rows: `n` other wordings of each scene's caption (`Scene.captions` after its
    own), the captions the one-caption world does not pair with its images."""
    schema = pa.schema([("key", pa.string()), ("caption", pa.string())])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, scenes, batch):
            keys, captions = [], []
            for index in range(start, min(start + batch, scenes)):
                for text in sample_scene(seed, index).captions(n + 1, seed, index)[1:]:
                    keys.append(f"toy-{seed}-{index:07d}")
                    captions.append(text)
            writer.write_table(pa.table({"key": keys, "caption": captions}, schema=schema))


@declare(pairs=COUNT, seed=SEED, shard_size=COUNT, captions_per_scene=COUNT, other_captions=at_least(0))
def build_world(out: Path, pairs: int, seed: int = 0, shard_size: int = 1000, overwrite: bool = False,
                captions_per_scene: int = 1, other_captions: int = 0) -> DatasetSpec:
    """Write `pairs` toy-world samples (pairs / captions_per_scene scenes) as WebDataset shards
    plus manifest.yaml into `out`; with `other_captions` N (one-caption worlds), also N other
    wordings of every caption in `out/captions/other-captions.parquet`."""
    if pairs % captions_per_scene:
        raise ConfigError(f"pairs ({pairs}) must be a multiple of captions_per_scene ({captions_per_scene})",
                          "pairs", "captions_per_scene")
    if other_captions and captions_per_scene > 1:
        raise ConfigError("other_captions (other wordings written beside a one-caption world) must be 0 when "
                          "captions_per_scene is above 1", "other_captions", "captions_per_scene")
    target = open_output(out, (), "out", kind="directory", overwrite=overwrite)
    out = target.path
    scenes = pairs // captions_per_scene
    name = f"toy-world-seed{seed}" + (f"-{captions_per_scene}-captions" if captions_per_scene > 1 else "")
    with target.stage() as tmp:
        write_shards((s for i in range(scenes) for s in samples(seed, i, captions_per_scene)), tmp, prefix="toy",
                     maxcount=shard_size)
        spec = DatasetSpec(format="webdataset", shards=[str(out / p.name) for p in sorted(tmp.glob("toy-*.tar"))],
                           fields=Fields(image="png"), name=name)
        write_manifest(tmp / "manifest.yaml", spec, shards_relative_to=out)
        if other_captions:
            (tmp / OTHER_CAPTIONS).parent.mkdir()
            write_other_captions(tmp / OTHER_CAPTIONS, seed, scenes, other_captions)
    return spec
