"""COCO-mini (real JPEGs + human captions, shared/data/coco-mini) as WebDataset shards or Parquet.

Used by tests, benchmarks and `pairclean synth coco-mini`: one pair per image with its first
caption (or every caption with --all-captions), key = the COCO image id.
"""

from __future__ import annotations

import json
import multiprocessing
from contextlib import nullcontext
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pairclean.config import COUNT, SEED, SHARE, declare
from pairclean.errors import ConfigError
from pairclean.data.manifest import write_manifest
from pairclean.data.spec import DatasetSpec
from pairclean.data.writer import write_shards
from pairclean.ops.guard import open_output
from pairclean.ops.records import Keyed


@declare(limit=COUNT)
def read_pairs(src: Path, all_captions: bool = False, limit: int | None = None) -> list[dict]:
    lines_path = Path(src) / "pairs.jsonl"
    if not lines_path.is_file():
        raise ConfigError(f"{lines_path} not found: point `src` at shared/data/coco-mini", "src")
    pairs = []
    for line in lines_path.read_text().splitlines():
        rec = json.loads(line)
        captions = rec["captions"] if all_captions else rec["captions"][:1]
        for j, caption in enumerate(captions):
            pairs.append({"key": f"{rec['image_id']:012d}" + (f"_{j}" if all_captions else ""),
                          "image": rec["image"], "caption": caption})
        if limit and len(pairs) >= limit:
            break
    return pairs[:limit] if limit else pairs


@declare(shard_size=COUNT)
def build_shards(src: Path, out: Path, shard_size: int = 100, all_captions: bool = False,
                 limit: int | None = None, overwrite: bool = False) -> DatasetSpec:
    target = open_output(out, [src], "out", kind="directory", overwrite=overwrite)
    pairs = read_pairs(src, all_captions, limit)
    out = target.path
    with target.stage() as tmp:
        write_shards(({"__key__": p["key"], "jpg": (Path(src) / p["image"]).read_bytes(), "txt": p["caption"]}
                      for p in pairs), tmp, prefix="coco-mini", maxcount=shard_size)
    shards = [str(p) for p in sorted(out.glob("coco-mini-*.tar"))]
    spec = DatasetSpec(format="webdataset", shards=shards, name="coco-mini")
    write_manifest(out / "manifest.yaml", spec)
    return spec


def build_parquet(src: Path, out_file: Path, by_path: bool = False, all_captions: bool = False,
                  limit: int | None = None, overwrite: bool = False) -> Path:
    """Images as a bytes column, or (by_path) as paths relative to the Parquet file's directory."""
    target = open_output(out_file, [src], "out", overwrite=overwrite)
    pairs = read_pairs(src, all_captions, limit)
    columns = {"key": [p["key"] for p in pairs], "caption": [p["caption"] for p in pairs]}
    if by_path:
        columns["image_path"] = [p["image"] for p in pairs]
    else:
        columns["image"] = [(Path(src) / p["image"]).read_bytes() for p in pairs]
    with target.write() as tmp:
        pq.write_table(pa.table(columns), tmp, row_group_size=64)
    return target.path


WEB_SIDE = (256, 384)  # img2dataset's usual download sizes: the longer side, in pixels


def web_pair(src: Path, record: dict, seed: int, i: int, progressive: float = 0.0, bad: float = 0.0) -> Keyed:
    """Pair `i` of a web-style dataset: the COCO image cropped (70-100% of each side, position and
    mirror drawn from (seed, i)), resized so its longer side is 256-384 px, re-encoded as a JPEG
    at quality 80-95 (a progressive one with probability `progressive`, as web crawls hold some),
    with one of its human captions; with probability `bad` its image is one of the files a web
    crawl also holds (`BAD_KINDS`, `spoiled`). A function of (seed, i) alone; with `progressive` and
    `bad` 0 the same bytes as before they existed (their draws come last, and only then)."""
    import io
    import random

    from PIL import Image, ImageOps

    rng = random.Random(f"{seed}:{i}")
    with Image.open(Path(src) / record["image"]) as img:
        img = img.convert("RGB")
        width, height = img.size
        cw, ch = int(width * rng.uniform(0.7, 1.0)), int(height * rng.uniform(0.7, 1.0))
        left, top = rng.randint(0, width - cw), rng.randint(0, height - ch)
        img = img.crop((left, top, left + cw, top + ch))
        if rng.random() < 0.5:
            img = ImageOps.mirror(img)
        side = rng.randint(*WEB_SIDE)
        scale = side / max(cw, ch)
        img = img.resize((max(1, round(cw * scale)), max(1, round(ch * scale))), Image.Resampling.BICUBIC)
        quality, caption = rng.randint(80, 95), rng.choice(record["captions"])
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=quality, progressive=progressive > 0 and rng.random() < progressive)
        data = buf.getvalue()
        if bad > 0 and rng.random() < bad:
            data = spoiled(img, data, rng.choice(BAD_KINDS), rng)
    return {"__key__": f"{seed:03d}{i:09d}", "jpg": data, "txt": caption}


# What a web crawl's image members hold besides baseline RGB JPEGs (stored under `.jpg` as downloaded):
# files cut short, other formats and colour spaces, empty files, and headers declaring more pixels
# than any decoder should allocate (65,000 x 65,000: over `data.decode.MAX_PIXELS`).
BAD_KINDS = ("truncated", "png", "webp", "cmyk", "progressive", "grayscale", "empty", "huge")
HUGE_SIDE = 65_000
_RE_ENCODED = {"png": ("RGB", "PNG", {}), "webp": ("RGB", "WEBP", {"quality": 85}),
               "cmyk": ("CMYK", "JPEG", {"quality": 90}), "grayscale": ("L", "JPEG", {"quality": 90}),
               "progressive": ("RGB", "JPEG", {"quality": 90, "progressive": True})}  # kind: mode, format, options


def spoiled(img, data: bytes, kind: str, rng) -> bytes:
    """The image `img` (whose baseline JPEG is `data`) as a file of `kind` (`BAD_KINDS`); `rng` draws
    where a truncated file ends."""
    import io

    if kind == "truncated":  # a download cut off: the header whole, the scan ending 30-90% of the way
        return data[:int(len(data) * rng.uniform(0.3, 0.9))]
    if kind == "empty":
        return b""
    if kind == "huge":  # the frame header's height and width rewritten; the scan as it was
        at = 2
        while data[at + 1] not in (0xC0, 0xC1, 0xC2):  # segment by segment to the frame header
            at += 2 + int.from_bytes(data[at + 2:at + 4], "big")
        side = HUGE_SIDE.to_bytes(2, "big")
        return data[:at + 5] + side + side + data[at + 9:]
    mode, fmt, options = _RE_ENCODED[kind]
    buf = io.BytesIO()
    img.convert(mode).save(buf, format=fmt, **options)
    return buf.getvalue()


class _WebPairs:
    """`web_pair(src, records[i % len], seed, i, progressive, bad)` as a picklable function of i, for a process pool."""

    def __init__(self, src: Path, records: list[dict], seed: int, progressive: float, bad: float):
        self.src, self.records, self.seed, self.progressive, self.bad = src, records, seed, progressive, bad

    def __call__(self, i: int) -> Keyed:
        return web_pair(self.src, self.records[i % len(self.records)], self.seed, i, self.progressive, self.bad)


@declare(shards=COUNT, pairs_per_shard=COUNT, seed=SEED, jobs=COUNT, progressive=SHARE, bad_share=SHARE)
def build_web_shards(src: Path, out: Path, shards: int = 2, pairs_per_shard: int = 5000, seed: int = 0,
                     overwrite: bool = False, jobs: int = 1, progressive: float = 0.0,
                     bad_share: float = 0.0) -> DatasetSpec:
    """Shards shaped like img2dataset's (thousands of 256-384 px JPEGs each) from COCO-mini's
    images, cycled and varied deterministically (`web_pair`): data to measure throughput on.
    `jobs` processes render the pairs (15-20 ms each); the shards are the same whatever `jobs`.
    `progressive`: the share of JPEGs written progressive (decoders treat them otherwise);
    `bad_share`: the share of images that are not baseline RGB JPEGs, or not whole (`BAD_KINDS`), as
    every web shard holds some: what a device decoder must survive at the cost of that image alone."""
    lines_path = Path(src) / "pairs.jsonl"
    if not lines_path.is_file():
        raise ConfigError(f"{lines_path} not found: point `src` at shared/data/coco-mini", "src")
    target = open_output(out, [src], "out", kind="directory", overwrite=overwrite)
    records = [json.loads(line) for line in lines_path.read_text().splitlines() if line.strip()]
    out = target.path
    render, indexes = _WebPairs(src, records, seed, progressive, bad_share), range(shards * pairs_per_shard)
    with target.stage() as tmp, (multiprocessing.get_context("spawn").Pool(jobs) if jobs > 1 else nullcontext()) as pool:
        pairs = pool.imap(render, indexes, chunksize=32) if pool is not None else map(render, indexes)
        write_shards(pairs, tmp, prefix="web", maxcount=pairs_per_shard, maxsize=float("inf"))
    spec = DatasetSpec(format="webdataset", shards=[str(p) for p in sorted(out.glob("web-*.tar"))], name="coco-web")
    write_manifest(out / "manifest.yaml", spec)
    return spec
