"""COCO captions as text-text pairs: two human captions of the same image are a clean pair.

The real-estimator lab world (product.md): captions_val2017.json (5,000 images) becomes one pair
per image, (first caption, second caption) in annotation-file order, key = the image id.
`pairclean corrupt` then swaps second captions between images to make known noise.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pairclean.ops.atomic import atomic_path
from pairclean.config import COUNT, check_choice, declare
from pairclean.errors import UserError
from pairclean.data.manifest import write_manifest
from pairclean.data.spec import DatasetSpec
from pairclean.data.writer import write_shards
from pairclean.ops.guard import open_output


OTHER_CAPTIONS = "captions/other-captions.parquet"  # beside the pairs: each image's captions after its first two


@declare(limit=COUNT)
def caption_pairs(captions_json: str | Path, limit: int | None = None) -> list[dict]:
    """[{key, text, text2, others}] in image-id order (`others`: the image's remaining captions);
    images with fewer than two captions are skipped."""
    path = Path(captions_json)
    if path.is_dir():
        path = path / "captions_val2017.json"
    try:
        data = json.loads(path.read_text())
        annotations = data["annotations"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"cannot read COCO captions from {path}: {str(exc).splitlines()[0][:200]}") from None
    by_image: dict[int, list[str]] = defaultdict(list)
    for ann in annotations:
        caption = str(ann.get("caption", "")).strip()
        if caption:
            by_image[int(ann["image_id"])].append(caption)
    pairs = [{"key": f"{image_id:012d}", "text": caps[0], "text2": caps[1], "others": caps[2:]}
             for image_id, caps in sorted(by_image.items()) if len(caps) >= 2]
    return pairs[:limit] if limit else pairs


def _write_tars(pairs: list[dict], tmp: Path, shard_size: int) -> list[str]:
    written = write_shards(({"__key__": p["key"], "txt": p["text"], "txt2": p["text2"]} for p in pairs),
                           tmp, prefix="coco-text", maxcount=shard_size)
    return [p.name for p in written]


def _write_parquet(pairs: list[dict], tmp: Path, shard_size: int) -> list[str]:
    name = "coco-text.parquet"
    table = pa.table({"key": [p["key"] for p in pairs], "caption": [p["text"] for p in pairs],
                      "caption2": [p["text2"] for p in pairs]})
    with atomic_path(tmp / name) as part:
        pq.write_table(table, part, row_group_size=shard_size)
    return [name]


WRITERS = {"webdataset": _write_tars, "parquet": _write_parquet}  # the formats this world is written in


@declare(shard_size=COUNT)
def build_text_pairs(captions_json: str | Path, out: str | Path, format: str = "webdataset",
                     shard_size: int = 1000, limit: int | None = None, overwrite: bool = False) -> DatasetSpec:
    """Write the caption pairs as WebDataset shards (txt, txt2) or one Parquet file, plus manifest.yaml
    and, for `corrupt --mode duplicate`, every image's other captions (captions/other-captions.parquet)."""
    check_choice(format, WRITERS, "format")
    target = open_output(out, [captions_json], "out", kind="directory", overwrite=overwrite)
    pairs = caption_pairs(captions_json, limit)
    if not pairs:
        raise UserError(f"no image in {captions_json} has two captions")
    out = target.path
    with target.stage() as tmp:
        names = WRITERS[format](pairs, tmp, shard_size)
        spec = DatasetSpec(format=format, shards=[str(tmp / n) for n in names], pair="text-text", name="coco-text")
        write_manifest(tmp / "manifest.yaml", spec)
        (tmp / OTHER_CAPTIONS).parent.mkdir()
        pq.write_table(pa.table({"key": [p["key"] for p in pairs for _ in p["others"]],
                                 "caption": [c for p in pairs for c in p["others"]]}), tmp / OTHER_CAPTIONS)
    spec = replace(spec, shards=[str(out / n) for n in names], sources=[str(out / n) for n in names])
    return spec
