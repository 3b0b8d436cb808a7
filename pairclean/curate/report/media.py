"""The gallery's media: thumbnails and texts of the pairs it shows, read from the shards themselves
through the dataset reader (`data.reader.read_unit`), only the units that hold a gallery pair."""

from __future__ import annotations

import base64
import io
import os
from dataclasses import dataclass, field, replace

from pairclean.data.decode import DecodeError, decode_image
from pairclean.data.manifest import DatasetSpec, open_dataset
from pairclean.data.reader import RawPair, count_pairs, list_units, read_unit
from pairclean.errors import UserError
from pairclean.scores.db import match_shards


@dataclass
class Media:
    """What the gallery shows of one pair: images (thumbnail data URIs) and texts."""

    images: list[str | None] = field(default_factory=list)  # None: present but undecodable
    texts: list[str] = field(default_factory=list)
    note: str | None = None  # why something is missing


def thumbnail_uri(data: bytes, size: int) -> str:
    """A JPEG data URI no larger than size x size (raises DecodeError for a bad image)."""
    img = decode_image(data, draft_size=size)
    img.thumbnail((size, size))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=85, optimize=True)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def media_spec(shards: list[str] | None, provenance: dict) -> tuple[DatasetSpec | None, str | None]:
    """The dataset to take thumbnails from: `shards`, else the shards named in the provenance."""
    pair = provenance.get("pair")
    if shards:
        return open_dataset(shards, pair=pair), None
    recorded = provenance.get("input_shards") or []
    present = [s for s in recorded if os.path.exists(s)]
    if not recorded or len(present) < len(recorded):
        return None, "pass `shards` to see the pairs: the scored shards are not where the scores say"
    try:
        return open_dataset(present, pair=pair), None
    except UserError as exc:  # e.g. scored from precomputed embeddings: the inputs hold no pairs to show
        return None, f"pass `shards` to see the pairs: the scored inputs are not a dataset of pairs ({exc})"


def _units_for(spec: DatasetSpec, path: str, indices: set[int]) -> dict[str, set[int]]:
    """The units of the file `path` holding these row indices: a file read as one unit holds them
    all; a file read in several (Parquet row groups) is walked by each unit's row count."""
    units = list_units(replace(spec, shards=[path]))
    if len(units) == 1:
        return {units[0]: indices}
    found: dict[str, set[int]] = {}
    start = 0
    for unit in units:
        rows = count_pairs(spec, unit)
        inside = {i for i in indices if start <= i < start + rows}
        if inside:
            found[unit] = inside
        start += rows
    return found


def _read_pairs(spec: DatasetSpec, wanted: dict[str, set[int]]) -> dict[tuple[str, int], RawPair]:
    """RawPairs at the wanted (shard path -> indices); stops reading a unit once all are found."""
    found: dict[tuple[str, int], RawPair] = {}
    for path, indices in wanted.items():
        for unit, needed in _units_for(spec, path, indices).items():
            left = set(needed)
            for item in read_unit(spec, unit):
                if isinstance(item, RawPair) and item.index in left:
                    found[(path, item.index)] = item
                    left.discard(item.index)
                    if not left:
                        break
    return found


def _thumb(data, size: int) -> str | None:
    try:
        return thumbnail_uri(data, size)
    except DecodeError:
        return None


def fetch_media(spec: DatasetSpec, rows: list[dict], thumb: int) -> dict[tuple[str, int], Media]:
    """Thumbnails and texts for gallery rows (keyed by the scored (shard, index))."""
    mapping = {scored: given for given, scored in match_shards(spec.shards, sorted({r["shard"] for r in rows})).items()
               if scored is not None}
    wanted: dict[str, set[int]] = {}
    for r in rows:
        if r["shard"] in mapping:
            wanted.setdefault(mapping[r["shard"]], set()).add(int(r["index"]))
    pairs = _read_pairs(spec, wanted)
    # Text-text pairs often come from image datasets: show the sample's image as context.
    context = {}
    if spec.pair == "text-text":
        context = _read_pairs(DatasetSpec(format=spec.format, shards=spec.shards, pair="image-text",
                                          fields=spec.fields), wanted)
    media = {}
    for r in rows:
        key = (r["shard"], int(r["index"]))
        path = mapping.get(r["shard"])
        pair = pairs.get((path, key[1])) if path else None
        if pair is None:
            media[key] = Media(note="not found in the given shards")
            continue
        m = Media()
        for side in (pair.left, pair.right):
            if isinstance(side, bytes):
                m.images.append(_thumb(side, thumb))
            elif isinstance(side, str):
                m.texts.append(side)
        ctx = context.get((path, key[1]))
        if ctx is not None and isinstance(ctx.left, bytes):
            m.images.insert(0, _thumb(ctx.left, thumb))
        media[key] = m
    return media
