"""Precomputed embeddings: the layouts other tools write, recognised, checked and read without a model.

  clip-retrieval  DIR/img_emb/img_emb_N.npy + DIR/text_emb/text_emb_N.npy (+ DIR/metadata/metadata_N.parquet;
                  `pairclean score --save-embeddings` writes this layout (`saved.py`), its metadata naming
                  each pair's dataset shard and index, and DIR/provenance.json)
  numpy           LEFT.npy RIGHT.npy, row i of one paired with row i of the other (+ a keys Parquet)
  parquet-embeddings  FILE.parquet ...: a key column and two list<float> embedding columns
  datacomp-npz    DataComp's metadata/HASH.npz (b32_img, b32_txt, l14_img, l14_txt; row i = row i
                  of metadata/HASH.parquet, keyed by its `uid`); a pool root with metadata/ and
                  shards/ also names the pairs the embeddings describe, so later commands find them

Every layout is one stateless class with one contract (`EmbeddingLayout`): `claim(sources)` (are
these files my layout?), `locate(request)` (which arrays or files hold the rows; every structural
problem a UserError), `units(source, unit_rows)` and `batches(source, unit, batch_rows)`.
`open_embeddings` runs detection and `locate` once and returns an immutable `EmbeddingSource`.

A unit (the grain of resume) is a chunk of rows of one array pair (`left.npy#rows=A-B`, an .npz
member pair likewise) or one Parquet row group (`file.parquet#rg=N`). Array rows are read (pread
at the row's offset, after the header was parsed) block by block into reused per-thread buffers
(`batches.py`), so resident memory is a few blocks, not the file; Parquet rows come a record batch
at a time. The arithmetic on them (cosines, norms, beta) is `scoring.embeddings`.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pairclean.config import check_choice
from pairclean.data.dataset import open_dataset
from pairclean.data.embeddings.batches import ArrayRows, EmbeddingBatch, NpyRows, list_column, read_metadata
from pairclean.data.embeddings.npy import NpyFiles, NpyPair, npy_file, npy_pair, npz_member
from pairclean.data.embeddings.saved import (CLIP_RETRIEVAL, SAVED_PROVENANCE, UNFINISHED, SavedEmbeddings,
                                             read_saved_provenance)
from pairclean.data.embeddings.source import EmbeddingSource
from pairclean.data.patterns import resolve_shards
from pairclean.data.record import DatasetRecord
from pairclean.data.spec import PAIR_KINDS
from pairclean.data.units import Unit
from pairclean.errors import ConfigError, UserError
from pairclean.ops.places import readable
from pairclean.ops.notices import notice
from pairclean.ops.records import Keyed


@dataclass(frozen=True)
class Request:
    """What the user asked for: the paths named, and the fields (None: the layout's default)."""

    sources: tuple[str, ...]
    left_field: str
    right_field: str
    key_field: str | None = None
    keys_file: str | None = None  # the numpy layout's key Parquet


@dataclass(frozen=True)
class Located:
    """What a layout found: the rows' arrays or files, and what the files recorded themselves."""

    npy: tuple[NpyPair, ...] = ()
    parquet: tuple[str, ...] = ()
    pair: str | None = None  # the pair kind the files record (a directory `score --save-embeddings` wrote)
    pairs: DatasetRecord | None = None  # the dataset of pairs the embeddings describe
    saved: SavedEmbeddings | None = None  # DIR/provenance.json


LAYOUTS: dict[str, type["EmbeddingLayout"]] = {}


def register_layout(cls: type["EmbeddingLayout"]) -> type["EmbeddingLayout"]:
    LAYOUTS[cls.name] = cls
    return cls


class EmbeddingLayout(ABC):
    """A layout of precomputed embeddings. Stateless: every method is a classmethod, handed the
    request (`locate`) or the opened source (`units`, `batches`). The array layouts share `units`
    and `batches` (row chunks of .npy data); a layout of another kind overrides both."""

    name: ClassVar[str]
    label: ClassVar[str]
    priority: ClassVar[int] = 100  # detection asks lower numbers first
    default_fields: ClassVar[tuple[str | None, str | None]] = (None, None)  # (left, right) when not given
    # rows are arrays at fixed offsets (`source.npy`), readable by position with `NpyFiles` (what dedup needs)
    rows_in_place: ClassVar[bool] = True

    @classmethod
    @abstractmethod
    def claim(cls, sources: list[str]) -> bool:
        """Whether these paths are this layout."""

    @classmethod
    @abstractmethod
    def locate(cls, request: Request) -> Located:
        """The arrays or files that hold the rows (every structural problem a UserError)."""

    @classmethod
    def units(cls, source: EmbeddingSource, unit_rows: int) -> list[str]:
        return [str(Unit.rows(n.left, a, min(a + unit_rows, n.rows))) for n in source.npy
                for a in range(0, n.rows, unit_rows)]

    @classmethod
    def batches(cls, source: EmbeddingSource, unit: str, batch_rows: int) -> Iterator[EmbeddingBatch]:
        parsed = Unit.parse(unit)
        left_path, start, stop = parsed.path, parsed.part.start, parsed.part.stop
        pair = next(n for n in source.npy if n.left == left_path)
        meta = read_metadata(pair, start, stop)
        files = NpyFiles(pair)
        try:
            for a in range(start, stop, batch_rows):
                b = min(a + batch_rows, stop)
                rows = meta.slice(a - start, b - a) if meta is not None else None
                yield EmbeddingBatch(pair.left, np.arange(a, b, dtype=np.int64),
                                     rows.column("key").combine_chunks() if rows is not None else None,
                                     NpyRows(files, a, b),
                                     origin=(rows.column("shard").combine_chunks(), rows.column("index").combine_chunks())
                                     if pair.origin else None)
        finally:
            files.close()


def _numbered(directory: Path, prefix: str, suffix: str) -> Keyed[str, Path]:
    pattern = re.compile(re.escape(prefix) + r"(\d+)" + re.escape(suffix) + "$")
    found = {}
    for path in directory.iterdir() if directory.is_dir() else []:
        match = pattern.match(path.name)
        if match:
            found[match.group(1)] = path
    return found


@register_layout
class ClipRetrieval(EmbeddingLayout):
    name = "clip-retrieval"
    label = "clip-retrieval embeddings"
    priority = 10
    default_fields = ("img_emb", "text_emb")

    @classmethod
    def claim(cls, sources: list[str]) -> bool:
        return len(sources) == 1 and Path(sources[0]).is_dir() and (Path(sources[0]) / "img_emb").is_dir()

    @classmethod
    def locate(cls, request: Request) -> Located:
        if len(request.sources) != 1 or not Path(request.sources[0]).is_dir():
            raise UserError("the clip-retrieval layout is one directory holding img_emb/ and text_emb/")
        root = Path(request.sources[0])
        images = _numbered(root / "img_emb", CLIP_RETRIEVAL["img_emb"], ".npy")
        texts = _numbered(root / "text_emb", CLIP_RETRIEVAL["text_emb"], ".npy")
        if (root / UNFINISHED).is_file():
            raise UserError(f"{root} holds the embeddings of an unfinished `pairclean score` run ({len(images)} "
                            "block(s) so far): re-run the command that writes it to finish them before reading them")
        metadata = _numbered(root / "metadata", CLIP_RETRIEVAL["metadata"], ".parquet")
        if not images:
            raise UserError(f"{root}/img_emb holds no img_emb_N.npy files")
        unmatched = sorted(set(images) ^ set(texts))
        if unmatched:
            raise UserError(f"{root}: img_emb and text_emb files do not pair up (unmatched number {unmatched[0]})")
        saved = read_saved_provenance(root)
        npy = tuple(npy_pair(npy_file(str(images[n])), npy_file(str(texts[n])),
                             str(metadata[n]) if n in metadata else None, request.key_field)
                    for n in sorted(images, key=int))
        if saved is not None:  # the pair kind and dataset the saving run scored
            saved.check_blocks(root, {int(n): pair.rows for n, pair in zip(sorted(images, key=int), npy)})
            return Located(npy=npy, pair=saved.pair, saved=saved, pairs=saved.dataset)
        if any(pair.origin for pair in npy):
            notice(f"{root} has no {SAVED_PROVENANCE} but its metadata names each row's shard and index, as "
                   "`pairclean score` writes them: if a run of it wrote this directory, that run did not finish and "
                   "the directory may hold part of the dataset only")
        return Located(npy=npy)


@register_layout
class NumpyPair(EmbeddingLayout):
    name = "numpy"
    label = "two .npy arrays"
    priority = 30
    default_fields = ("left", "right")

    @classmethod
    def claim(cls, sources: list[str]) -> bool:
        return bool(sources) and all(s.endswith(".npy") for s in sources)

    @classmethod
    def locate(cls, request: Request) -> Located:
        if len(request.sources) != 2:
            raise UserError(f"the numpy layout is two .npy files (left, right), got {len(request.sources)} path(s)")
        return Located(npy=(npy_pair(npy_file(request.sources[0]), npy_file(request.sources[1]), request.keys_file,
                                     request.key_field),))


@register_layout
class DataCompNpz(EmbeddingLayout):
    """DataComp's pool metadata: `metadata/HASH.npz` beside `metadata/HASH.parquet`, row-aligned."""

    name = "datacomp-npz"
    label = "DataComp embeddings (.npz)"
    priority = 20
    default_fields = ("b32_img", "b32_txt")

    @staticmethod
    def _metadata_dir(source: str) -> Path | None:
        path = Path(source)
        if path.is_dir() and (path / "metadata").is_dir():
            path = path / "metadata"
        return path if path.is_dir() and any(path.glob("*.npz")) else None

    @classmethod
    def claim(cls, sources: list[str]) -> bool:
        return bool(sources) and all(s.endswith(".npz") or cls._metadata_dir(s) is not None for s in sources)

    @classmethod
    def locate(cls, request: Request) -> Located:
        files: list[Path] = []
        for source in request.sources:
            folder = cls._metadata_dir(source)
            files.extend(sorted(folder.glob("*.npz")) if folder is not None else [Path(source)])
        npy = []
        left, right = request.left_field, request.right_field
        for npz in files:
            metadata = npz.with_suffix(".parquet")
            npy.append(npy_pair((f"{npz}[{left}]", str(npz), *npz_member(str(npz), left)),
                                (f"{npz}[{right}]", str(npz), *npz_member(str(npz), right)),
                                str(metadata) if metadata.is_file() else None, request.key_field, ("uid",)))
        return Located(npy=tuple(npy), pairs=cls._pairs(files))

    @staticmethod
    def _pairs(files: list[Path]) -> DatasetRecord | None:
        """The pool's shards: `shards/` beside `metadata/`, as download_upstream.py lays the pool out."""
        roots = {f.parent.parent for f in files if f.parent.name == "metadata"}
        if len(roots) != 1 or not (shards := next(iter(roots)) / "shards").is_dir():
            return None
        try:
            return open_dataset(str(shards)).record()
        except UserError:
            return None


def _check_parquet(path: str, left_field: str, right_field: str, key_field: str | None) -> None:
    try:
        names = pq.ParquetFile(path).schema_arrow
    except Exception as exc:  # pyarrow raises several types for a file that is not Parquet
        raise UserError(f"cannot read Parquet {path}: {str(exc).splitlines()[0][:200]}") from None
    for name in (left_field, right_field) + ((key_field,) if key_field else ()):
        if name not in names.names:
            raise ConfigError(f"{path} has no column {name!r} (it has {names.names}); "
                              "name the columns with `left_field` / `right_field` / `key_field`",
                              "left_field", "right_field", "key_field")
    for name in (left_field, right_field):
        kind = names.field(name).type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)) \
                or not pa.types.is_floating(kind.value_type):
            raise UserError(f"column {name!r} of {path} is {kind}; an embedding column must be a list of floats")


def _parquet_dim(paths: tuple[str, ...], column: str) -> int:
    """The embedding dimension: the length of the first non-null vector of the left column."""
    for path in paths:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=[column]):
            lengths = pc.drop_null(pc.list_value_length(batch.column(0)))
            if len(lengths) and lengths[0].as_py() == 0:
                raise UserError(f"column {column!r} of {path} holds an embedding of 0 values: an embedding has at "
                                "least one value")
            if len(lengths):
                return int(lengths[0].as_py())
    raise UserError(f"column {column!r} holds no embedding in {', '.join(paths)}")


@register_layout
class ParquetEmbeddings(EmbeddingLayout):
    name = "parquet-embeddings"
    label = "Parquet embeddings"
    priority = 40
    default_fields = ("left_emb", "right_emb")
    rows_in_place = False  # list columns: a row is found by decoding its page, not at an offset

    @classmethod
    def claim(cls, sources: list[str]) -> bool:
        return bool(sources) and all(s.endswith(".parquet") or (Path(s).is_dir() and any(Path(s).glob("*.parquet")))
                                     for s in sources)

    @classmethod
    def locate(cls, request: Request) -> Located:
        parquet = tuple(s for s in resolve_shards(list(request.sources)) if s.endswith(".parquet"))
        if not parquet:
            raise UserError(f"no .parquet files in {', '.join(request.sources)}")
        for path in parquet:
            _check_parquet(path, request.left_field, request.right_field, request.key_field)
        return Located(parquet=parquet)

    @classmethod
    def units(cls, source: EmbeddingSource, unit_rows: int) -> list[str]:
        return [str(Unit.row_group(path, i)) for path in source.parquet
                for i in range(max(pq.ParquetFile(path).num_row_groups, 1))]

    @classmethod
    def batches(cls, source: EmbeddingSource, unit: str, batch_rows: int) -> Iterator[EmbeddingBatch]:
        parsed = Unit.parse(unit)
        path, rg = parsed.path, parsed.part
        pf = pq.ParquetFile(path)
        if pf.num_row_groups == 0:
            return
        offset = sum(pf.metadata.row_group(i).num_rows for i in range(rg))
        columns = [source.left_field, source.right_field] + ([source.key_field] if source.key_field else [])
        for batch in pf.iter_batches(batch_size=batch_rows, row_groups=[rg], columns=columns):
            left, bad = list_column(batch.column(source.left_field), source.dim, "left")
            right, bad_right = list_column(batch.column(source.right_field), source.dim, "right")
            for i, reason in bad_right.items():
                bad.setdefault(i, reason)
            keys = pc.cast(batch.column(source.key_field), pa.string()) if source.key_field else None
            yield EmbeddingBatch(path, np.arange(offset, offset + batch.num_rows, dtype=np.int64), keys,
                                 ArrayRows(left, right), bad)
            offset += batch.num_rows


# -- opening -----------------------------------------------------------------------------------


def detect_layout(sources: list[str]) -> str:
    for cls in sorted(LAYOUTS.values(), key=lambda c: c.priority):
        if cls.claim(sources):
            return cls.name
    raise ConfigError("cannot tell the embeddings layout of " + ", ".join(sources) + ": give a clip-retrieval "
                      "output directory (img_emb/, text_emb/, metadata/), two .npy files (left, right), DataComp's "
                      "metadata/ (.npz beside .parquet), or Parquet files with two embedding columns (or pass `layout`)",
                      "layout")


def open_embeddings(sources: str | list[str], layout: str = "auto", pair: str | None = None,
                    left_field: str | None = None, right_field: str | None = None, key_field: str | None = None,
                    keys: str | None = None) -> EmbeddingSource:
    """Resolve and check an embeddings input once; every structural problem is a UserError here."""
    named = [sources] if isinstance(sources, str) else [str(s) for s in sources]
    # Embeddings on an object store are read from a local mirror (memory-mapped, read by position).
    sources = [str(readable(s)) for s in named]
    for s in sources:
        if not Path(s).exists():
            raise UserError(f"path not found: {s}")
    check_choice(layout, ("auto", *LAYOUTS), "layout")
    layout = detect_layout(sources) if layout == "auto" else layout
    if pair is not None:
        check_choice(pair, PAIR_KINDS, "pair")
    if keys is not None and layout != NumpyPair.name:
        raise ConfigError("`keys` names the key file of the numpy layout (LEFT.npy RIGHT.npy); "
                          "clip-retrieval and DataComp keys come from their metadata, Parquet keys from `key_field`",
                          "keys", "key_field")
    cls = LAYOUTS[layout]
    request = Request(tuple(sources), left_field or cls.default_fields[0], right_field or cls.default_fields[1],
                      key_field, keys)
    found = cls.locate(request)
    dims = {n.dim for n in found.npy} if found.npy else {_parquet_dim(found.parquet, request.left_field)}
    if len(dims) > 1:
        raise UserError(f"the embedding files have different dimensions: {sorted(dims)}")
    return EmbeddingSource(
        layout=layout, pair=pair or found.pair or "image-text",  # else the kind the files record
        sources=tuple(named), left_field=request.left_field, right_field=request.right_field,
        key_field=key_field or next((n.key_column for n in found.npy if n.key_column), None),
        dim=dims.pop() if dims else None, reader=cls, npy=found.npy, parquet=found.parquet, keys_file=keys,
        pairs=found.pairs, saved=found.saved)
