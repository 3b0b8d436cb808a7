"""The gallery's media: thumbnails and texts of the pairs it shows, read from the shards themselves
through the dataset's reader (`data.dataset.Dataset.read`), only the units that hold a gallery pair.

The dataset is the one the scores file recorded (`scores.contract.scored_pairs`), opened again with
its format and field mapping, or the shards a user gives (read with the recorded mapping where they
are the recorded format). Rows are found by (shard, index), and each pair read must carry the key
the scores have at that position (a shard rewritten since, or another download named alike, stops
the page: it would show another pair under a row's scores); the files read must also be the ones
the scores recorded (`data.record`: their fingerprints; `allow_other_dataset` waives that check
only). Scores whose rows are not the dataset's (made from precomputed embeddings) find their pairs
by key, which must then be unique.
"""

from __future__ import annotations

import base64
import io
import os
from dataclasses import dataclass, field, replace

from pairclean.data.decode import DecodeError, decode_image
from pairclean.data.dataset import Dataset, open_dataset, reopen_dataset
from pairclean.data.record import DatasetRecord, check_same_dataset
from pairclean.data.rewriting.base import changed
from pairclean.data.spec import Fields, RawPair
from pairclean.errors import UserError
from pairclean.ops.records import Keyed
from pairclean.scorefile.contract import Provenance, from_embeddings, scored_pairs
from pairclean.scorefile.db import match_shards


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


def media_dataset(provenance: Provenance, shards: list[str] | None = None, fields: Fields | None = None,
                  **options) -> tuple[Dataset | None, str | None]:
    """The dataset to take thumbnails from: `shards` (read with the recorded mapping where they are
    the recorded format), else the dataset the scores recorded; `fields` and `options` (format,
    split, image_root, pair ...) override. (None, why) when there is none to open."""
    record = scored_pairs(provenance)
    options["pair"] = options.get("pair") or provenance.pair
    if shards:
        return reopen_dataset(record, shards, fields, **options), None
    if record is not None:
        try:
            return reopen_dataset(record, fields=fields, **options), None
        except UserError as exc:
            return None, f"pass `shards` to see the pairs: the scored dataset cannot be opened ({exc})"
    if from_embeddings(provenance):
        return None, ("pass `shards` to see the pairs: these scores were made from precomputed embeddings "
                      "that do not say where their pairs are (they are found by key)")
    recorded = provenance.input_shards or []  # a scores file from before datasets were recorded
    present = [s for s in recorded if os.path.exists(s)]
    if not recorded or len(present) < len(recorded):
        return None, "pass `shards` to see the pairs: the scored shards are not where the scores say"
    return open_dataset(present, pair=options["pair"]), None


def _units_for(dataset: Dataset, path: str, indices: set[int]) -> Keyed[str, set[int]]:
    """The units of the file `path` holding these row indices: a file read as one unit holds them
    all; a file read in several (Parquet row groups) is walked by each unit's row count."""
    units = Dataset(replace(dataset.spec, shards=[path])).units()
    if len(units) == 1:
        return {units[0]: indices}
    found: dict[str, set[int]] = {}
    start = 0
    for unit in units:
        rows = dataset.count(unit)
        inside = {i for i in indices if start <= i < start + rows}
        if inside:
            found[unit] = inside
        start += rows
    return found


def _read_pairs(dataset: Dataset, wanted: dict[str, dict[int, str | None]]) -> Keyed[tuple[str, int], RawPair]:
    """RawPairs at the wanted (shard path -> index -> the key the scores have there, None: any);
    stops reading a unit once all are found. A pair whose key is not the scored one means the
    shard is not what was scored: a UserError."""
    found: dict[tuple[str, int], RawPair] = {}
    for path, keys in wanted.items():
        for unit, needed in _units_for(dataset, path, set(keys)).items():
            left = set(needed)
            for item in dataset.read(unit):
                if isinstance(item, RawPair) and item.shard == path and item.index in left:
                    if keys[item.index] is not None and item.key != keys[item.index]:
                        raise changed(path, f"pair {item.index} is {item.key!r} in the shard but "
                                            f"{keys[item.index]!r} in the scores")
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


def locate_keys(dataset: Dataset, keys: set[str]) -> Keyed[str, tuple[str, int]]:
    """Where each key is in the dataset: key -> (shard, index), from the format's key listing of
    every shard. A wanted key found twice is refused: a pair matched by key must be one pair."""
    found: dict[str, tuple[str, int]] = {}
    for shard in dict.fromkeys(dataset.spec.shards):
        for index, key in enumerate(dataset.keys(shard)):
            if key in keys:
                if key in found:
                    raise UserError(f"key {key!r} is {found[key][0]}#{found[key][1]} and {shard}#{index} in the dataset: "
                                    "these scores find their pairs by key, and keys must then be unique")
                found[key] = (shard, index)
    return found


def fetch_media(dataset: Dataset, rows: list[dict], thumb: int, by_key: bool = False,
                recorded: DatasetRecord | None = None,
                allow_other_dataset: bool = False) -> Keyed[tuple[str, int], Media]:
    """Thumbnails and texts for gallery rows (keyed by the scored (shard, index)). `by_key`: the
    scores' rows are not the dataset's (precomputed embeddings), so each is found by its key.
    `recorded`: the dataset the scores recorded; the files read must be its files."""
    spec = dataset.spec
    if by_key or not any(match_shards(spec.shards, sorted({r["shard"] for r in rows})).values()):
        located = locate_keys(dataset, {r["key"] for r in rows})
        place = {(r["shard"], int(r["index"])): located.get(r["key"]) for r in rows}
        scored_key = {}  # found by their keys: nothing more to compare
    else:
        mapping = {scored: given for given, scored in
                   match_shards(spec.shards, sorted({r["shard"] for r in rows})).items() if scored is not None}
        place = {(r["shard"], int(r["index"])): (mapping[r["shard"]], int(r["index"])) if r["shard"] in mapping
                 else None for r in rows}
        scored_key = {place[(r["shard"], int(r["index"]))]: r["key"] for r in rows}
    wanted: dict[str, dict[int, str | None]] = {}
    for where in place.values():
        if where is not None:
            wanted.setdefault(where[0], {})[where[1]] = scored_key.get(where)
    check_same_dataset(recorded, list(wanted), "the scores file", allow_other_dataset)
    pairs = _read_pairs(dataset, wanted)
    # Text-text pairs often come from image datasets: show the sample's image as context.
    context = {}
    if spec.pair == "text-text":
        anywhere = {path: dict.fromkeys(keys) for path, keys in wanted.items()}  # keys were checked above
        context = _read_pairs(Dataset(replace(spec, pair="image-text")), anywhere)
    media = {}
    for r in rows:
        key = (r["shard"], int(r["index"]))
        where = place[key]
        pair = pairs.get(where) if where else None
        if pair is None:
            media[key] = Media(note="not found in the given shards")
            continue
        m = Media()
        for side in (pair.left, pair.right):
            if isinstance(side, bytes):
                m.images.append(_thumb(side, thumb))
            elif isinstance(side, str):
                m.texts.append(side)
        ctx = context.get(where)
        if ctx is not None and isinstance(ctx.left, bytes):
            m.images.insert(0, _thumb(ctx.left, thumb))
        media[key] = m
    return media
