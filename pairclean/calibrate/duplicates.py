"""Plant duplicates with ground truth (`pairclean corrupt --mode duplicate`), so dedup is measured.

A share `ratio` of the pairs (drawn in md5(seed:dup:position) order, the way corrupt's other
modes draw) gets one copy each, its kind cycled over `kinds` in that order:

    exact     the sample, byte for byte
    reencode  the image through JPEG at quality 50, stored again in its own format
    resize    the image at half its width and height
    crop      80% of the image's width and height at a seeded offset (not resized back)
    caption   the same image with another of its captions; for text-text pairs both texts
              replaced by two other captions of the same item (e.g. two more COCO captions)

`caption` needs the item's other captions: `other_captions`, a Parquet file of (key, caption)
rows holding captions of an item that the dataset does not pair with it (`pairclean synth
toy-world --other-captions N` and `lab.coco_text.build_text_pairs` write one); a drawn pair
without enough of them gets the next kind in the cycle. Image kinds apply to image-text pairs.

The originals are copied byte for byte (same shard names, order and keys); the copies go into new
shards `duplicates-NNNNNN.tar`, keyed `<original key>-copy`. `truth/truth.parquet` has one row
per output pair: key, shard, index, `noisy` (false: every caption still describes its image),
`dup_group` (the original's position, on the original and its copy), `dup_kind` ('original' or
the copy's kind), `dup_of_shard` / `dup_of_index` (a copy's original) and `left_sha1` /
`right_sha1` (hashes of the image or first text, and of the caption as read), by which
`evaluate dedup` also counts the identical items the source already held as duplicates.

Memory: the three passes of `calibrate.corrupt` (rows spilled to Parquet, the draw planned by DuckDB,
the data streamed again); a copy is made and written when its original passes.
"""

from __future__ import annotations

import hashlib
import io
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from pairclean.config import SEED, SHARE, check_choice, declare
from pairclean.data.dataset import Dataset, as_dataset
from pairclean.data.formats.webdataset import WebDatasetFormat
from pairclean.data.manifest import write_manifest
from pairclean.data.reading.tar import read_samples
from pairclean.data.rewriting import rewriter_for
from pairclean.data.rewriting.tar import member_named
from pairclean.data.spec import DatasetSpec, raise_failure
from pairclean.data.writer import shard_writer, write_shards
from pairclean.errors import ConfigError, UserError
from pairclean.calibrate.corrupt import TRUTH_NAME, CorruptResult, _check_source, _records, _spill_rows, caption_field
from pairclean.ops.atomic import write_json
from pairclean.ops.guard import Output, open_output
from pairclean.scorefile.sql import sandboxed_connection, sql_string

DUPLICATE_KINDS = ("exact", "reencode", "resize", "crop", "caption")
IMAGE_KINDS = ("reencode", "resize", "crop")
DUPLICATES_PREFIX = "duplicates"
COPY_SUFFIX = "-copy"
JPEG_QUALITY = 50
RESIZE = 0.5
CROP = 0.8
_SHARD_COPIES = 10_000  # copies per duplicates shard
TRUTH_SCHEMA = pa.schema([
    ("key", pa.string()), ("shard", pa.string()), ("index", pa.int64()), ("noisy", pa.bool_()),
    ("dup_group", pa.int64()), ("dup_kind", pa.string()), ("dup_of_shard", pa.string()), ("dup_of_index", pa.int64()),
    ("left_sha1", pa.string()), ("right_sha1", pa.string()),
])
_FORMATS = {"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}


def default_kinds(pair: str, other_captions: str | Path | None) -> tuple[str, ...]:
    """Every kind that applies to the pair kind (`caption` only with other captions to draw from)."""
    kinds = DUPLICATE_KINDS if pair == "image-text" else ("exact", "caption")
    return tuple(k for k in kinds if k != "caption" or other_captions is not None)


def _check_kinds(kinds: tuple[str, ...], pair: str, other_captions: Path | None) -> None:
    if not kinds:
        raise ConfigError("kinds is empty: name at least one duplicate kind", "kinds")
    for kind in kinds:
        check_choice(kind, DUPLICATE_KINDS, "kinds", "duplicate kind")
    if pair != "image-text" and set(kinds) & set(IMAGE_KINDS):
        raise ConfigError(f"{', '.join(sorted(set(kinds) & set(IMAGE_KINDS)))} change an image: {pair} pairs have "
                          "none to change (use exact, caption)", "kinds")
    if "caption" in kinds and other_captions is None:
        raise ConfigError("the caption kind draws another caption of the same item from `other_captions` "
                          "(a Parquet file of key, caption rows)", "other_captions", "kinds")
    if other_captions is not None and not Path(other_captions).is_file():
        raise UserError(f"other captions file not found: {other_captions}")


def _sha1(value: bytes | str | None) -> str | None:
    if value is None:
        return None
    return hashlib.sha1(value.encode("utf-8") if isinstance(value, str) else value).hexdigest()


def transform_image(data: bytes, ext: str, kind: str, rng: np.random.Generator) -> bytes:
    """The image changed by `kind`, encoded again in the format of its member extension."""
    image = Image.open(io.BytesIO(data))
    image.load()
    fmt = _FORMATS.get(ext.lower(), image.format or "PNG")
    mode = "RGB" if fmt == "JPEG" or kind == "reencode" else image.mode
    image = image.convert(mode) if image.mode != mode else image
    if kind == "reencode":
        buf = io.BytesIO()
        image.save(buf, format="JPEG", quality=JPEG_QUALITY)
        image = Image.open(io.BytesIO(buf.getvalue()))
        image.load()
    elif kind == "resize":
        image = image.resize((max(1, round(image.width * RESIZE)), max(1, round(image.height * RESIZE))),
                             Image.BICUBIC)
    elif kind == "crop":
        w, h = max(1, round(image.width * CROP)), max(1, round(image.height * CROP))
        x, y = int(rng.integers(0, image.width - w + 1)), int(rng.integers(0, image.height - h + 1))
        image = image.crop((x, y, x + w, y + h))
    out = io.BytesIO()
    image.save(out, format=fmt, **({"quality": 95} if fmt in ("JPEG", "WEBP") else {}))
    return out.getvalue()


def _plan(con, rows: Path, others: Path | None, count: int, seed: int, kinds: tuple[str, ...], pair: str,
          repl: Path) -> None:
    """The copies: (pos, kind, other, other2) sorted by position. `other`, `other2`: captions of the
    item other than its own (text-text: neither of its two texts), in a seeded order."""
    need = 2 if pair == "text-text" else 1
    if others is not None:
        con.execute(f"""CREATE TABLE others AS SELECT CAST(key AS VARCHAR) AS key, list(DISTINCT caption) AS captions
                        FROM read_parquet({sql_string(others)}) WHERE caption IS NOT NULL GROUP BY ALL""")
    else:
        con.execute("CREATE TABLE others (key VARCHAR, captions VARCHAR[])")
    plain = [k for k in kinds if k != "caption"]
    kind_sql = (f"list_extract({list(kinds)!r}::VARCHAR[], ((rank - 1) % {len(kinds)}) + 1)")
    fallback = (f"list_extract({plain!r}::VARCHAR[], ((rank - 1) % {len(plain)}) + 1)" if plain else "NULL")
    con.execute(f"""
        CREATE TABLE picked AS
        SELECT pos, rank, list_sort(list_filter(coalesce(captions, []), lambda c: c <> caption AND c IS DISTINCT FROM context),
                                    'ASC') AS others
        FROM (SELECT r.pos, r.caption, r.context, o.captions,
                     row_number() OVER (ORDER BY md5(concat(?, ':dup:', r.pos)), r.pos) AS rank
              FROM read_parquet({sql_string(rows)}) r LEFT JOIN others o USING (key) WHERE r.caption IS NOT NULL)
        WHERE rank <= {int(count)}""", [str(seed)])
    select = f"""
        WITH chosen AS (
            SELECT pos, rank, others,
                   CASE WHEN {kind_sql} <> 'caption' OR len(others) >= {need} THEN {kind_sql} ELSE {fallback} END AS kind
            FROM picked)
        SELECT pos, kind,
               CASE WHEN len(others) > 0 THEN list_extract(others, 1 + (hash(concat(?, ':caption:', pos))
                                                                         % len(others))::BIGINT) END AS other,
               CASE WHEN len(others) > 0 THEN list_extract(others, 1 + ((hash(concat(?, ':caption:', pos)) + 1)
                                                                         % len(others))::BIGINT) END AS other2
        FROM chosen WHERE kind IS NOT NULL ORDER BY pos"""
    con.execute(f"COPY ({select}) TO {sql_string(repl)} (FORMAT parquet)", [str(seed), str(seed)])


class _Copies:
    """Walks the spilled rows and the planned copies in position order, writes every truth row,
    and makes each copy when its original passes."""

    def __init__(self, rows: Path, repl: Path, dataset: Dataset, names: dict[str, str], out: Path, tmp: Path,
                 seed: int):
        self.rows, self.repl = _records(rows), _records(repl)
        self.next_repl = next(self.repl, None)
        spec = dataset.spec
        self.spec, self.rewriter, self.names, self.seed = spec, rewriter_for(dataset), names, seed
        self.text_field = spec.fields.text
        self.caption_field = caption_field(spec)
        self.image_fields = spec.fields.image_candidates() if spec.pair == "image-text" else []
        self.out, self.tmp = out, tmp
        self.truth = pq.ParquetWriter(tmp / TRUTH_NAME, TRUTH_SCHEMA)
        self.buf: dict[str, list] = {name: [] for name in TRUTH_SCHEMA.names}
        self.copies = shard_writer(str(tmp / f"{DUPLICATES_PREFIX}-%06d.tar"), maxcount=_SHARD_COPIES,
                                   maxsize=float("inf"), encoder=False)
        self.count: dict[str, int] = {}

    def _image(self, members: dict) -> tuple[str | None, bytes | None]:
        for ext in self.image_fields:
            if (member := member_named(members, ext)) is not None:
                return member, members[member]
        return None, None

    def _row(self, **values) -> None:
        for name in TRUTH_SCHEMA.names:
            self.buf[name].append(values.get(name))
        if len(self.buf["key"]) >= 65536:
            self._flush()

    def _flush(self) -> None:
        self.truth.write_table(pa.table(self.buf, schema=TRUTH_SCHEMA))
        for values in self.buf.values():
            values.clear()

    def take(self, shard: str, index: int, key: str, members: dict) -> None:
        row = next(self.rows, None)
        if row is None or row["shard"] != shard or row["index"] != index or row["key"] != key:
            raise UserError(f"{shard} changed while duplicates were planted; run again on a dataset nobody is writing")
        repl = self.next_repl if self.next_repl is not None and self.next_repl["pos"] == row["pos"] else None
        _, image = self._image(members)
        left = image if self.spec.pair == "image-text" else row["context"]
        self._row(key=key, shard=self.names[shard], index=index, noisy=False,
                  dup_group=row["pos"] if repl else None, dup_kind="original" if repl else None,
                  left_sha1=_sha1(left), right_sha1=_sha1(row["caption"]))
        if repl is None:
            return
        self.next_repl = next(self.repl, None)
        copy = dict(members)
        kind = repl["kind"]
        rng = np.random.default_rng([self.seed, row["pos"]])
        new_left, new_caption = left, row["caption"]
        if kind in IMAGE_KINDS:
            member, data = self._image(copy)
            copy[member] = new_left = transform_image(data, member.rsplit(".", 1)[-1], kind, rng)
        elif kind == "caption":
            new_caption = repl["other"]
            self.rewriter.replace_caption(copy, self.caption_field, new_caption)
            if self.spec.pair == "text-text":
                new_left = repl["other2"]
                copy[member_named(copy, self.text_field)] = new_left.encode("utf-8")
        number = sum(self.count.values())
        name = str(self.out / f"{DUPLICATES_PREFIX}-{number // _SHARD_COPIES:06d}.tar")
        self.copies.write({"__key__": key + COPY_SUFFIX, **copy})
        self.count[kind] = self.count.get(kind, 0) + 1
        self._row(key=key + COPY_SUFFIX, shard=name, index=number % _SHARD_COPIES, noisy=False,
                  dup_group=row["pos"], dup_kind=kind, dup_of_shard=self.names[shard], dup_of_index=index,
                  left_sha1=_sha1(new_left), right_sha1=_sha1(new_caption))

    def finish(self) -> list[str]:
        if next(self.rows, None) is not None:
            raise UserError("the dataset lost pairs while duplicates were planted; run again on a stable dataset")
        self._flush()
        self.copies.close()
        return sorted(p.name for p in self.tmp.glob(f"{DUPLICATES_PREFIX}-*.tar"))

    def close(self) -> None:
        self.truth.close()


@declare(ratio=SHARE, seed=SEED)
def plant_duplicates(source: str | list[str] | DatasetSpec | Dataset, out: str | Path | Output, ratio: float, seed: int = 0,
                     kinds: tuple[str, ...] | None = None, other_captions: str | Path | None = None,
                     overwrite: bool = False, progress: Callable[[str], None] | None = None) -> CorruptResult:
    """Copy `source` to `out` with a copy of a share `ratio` of its pairs in `duplicates-*.tar`,
    plus `truth/truth.parquet`, `manifest.yaml` and `corrupt.json` (`CorruptResult.selected`: the
    copies; `noisy`: 0)."""
    dataset = as_dataset(source)
    spec = dataset.spec
    other_captions = Path(other_captions) if other_captions is not None else None
    kinds = tuple(kinds) if kinds else default_kinds(spec.pair, other_captions)
    _check_source(dataset, ratio, "shuffle")  # the checks every copy of a dataset shares (shards, caption, ratio)
    _check_kinds(kinds, spec.pair, other_captions)
    if type(dataset.input_format) is not WebDatasetFormat:  # a plain copy: no sidecars to keep beside the shards
        raise UserError(f"duplicate mode writes its copies as plain WebDataset shards: give WebDataset input, not "
                        f"{dataset.input_format.label}")
    names = {s: rewriter_for(dataset).output_name(s) for s in dict.fromkeys(spec.shards)}
    if any(n.startswith(DUPLICATES_PREFIX + "-") for n in names.values()):
        raise UserError(f"an input shard is named {DUPLICATES_PREFIX}-*: the copies' shards would take its name")
    target = open_output(out, [*spec.shards, spec.truth, other_captions], "out", kind="directory", overwrite=overwrite)
    out = target.path
    with tempfile.TemporaryDirectory(prefix="pairclean-dup-") as work, target.stage() as tmp:
        work = Path(work)
        rows, repl = work / "rows.parquet", work / "copies.parquet"
        pairs, eligible = _spill_rows(dataset, dataset.units(), rows, progress)
        con = sandboxed_connection(work / "spill", files=[other_captions] if other_captions else [],
                                   directories=[work], database=str(work / "plan.duckdb"))
        try:
            _plan(con, rows, other_captions, round(ratio * eligible), seed, kinds, spec.pair, repl)
        finally:
            con.close()
        out_names = {s: str(out / n) for s, n in names.items()}
        (tmp / "truth").mkdir()
        copies = _Copies(rows, repl, dataset, out_names, out, tmp, seed)
        try:
            for shard in names:
                def samples(shard=shard):
                    for sample in read_samples(shard, raise_failure):
                        copies.take(shard, sample.index, sample.key, sample.members)
                        yield {"__key__": sample.key, **sample.members}

                prefix = f".{os.getpid()}-{names[shard][:-4]}"
                written = write_shards(samples(), tmp, prefix=prefix, maxcount=sys.maxsize, maxsize=float("inf"),
                                       encoder=False)
                os.replace(written[0], tmp / names[shard])
                if progress:
                    progress(f"wrote {out_names[shard]}")
            extra = copies.finish()
        finally:
            copies.close()
        new_spec = DatasetSpec(format=spec.format, shards=[*out_names.values(), *(str(out / n) for n in extra)],
                               pair=spec.pair, fields=spec.fields, label_template=spec.label_template,
                               truth=str(out / TRUTH_NAME), name=f"{spec.name or 'dataset'}-duplicate-{ratio:g}")
        write_manifest(tmp / "manifest.yaml", new_spec, shards_relative_to=out)
        planted = sum(copies.count.values())
        result = CorruptResult(out=out, truth=out / TRUTH_NAME, manifest=out / "manifest.yaml", mode="duplicate",
                               ratio=ratio, seed=seed, pairs=pairs + planted, eligible=eligible, selected=planted,
                               noisy=0)
        write_json(tmp / "corrupt.json", {**result.as_dict(), "source": spec.shards, "source_format": spec.format,
                                          "pair": spec.pair, "kinds": list(kinds), "copies_by_kind": copies.count,
                                          "other_captions": str(other_captions) if other_captions else None,
                                          "selection": "md5(seed:dup:position) order: the first round(ratio * eligible) "
                                                       "pairs, kinds cycled in that order"})
    return result
