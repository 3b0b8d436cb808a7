"""Precomputed embeddings: the layouts other tools write, read block by block without a model.

Layouts (each one format class, kind "embeddings"):
  clip-retrieval  DIR/img_emb/img_emb_N.npy + DIR/text_emb/text_emb_N.npy (+ DIR/metadata/metadata_N.parquet;
                  `pairclean score --save-embeddings` writes this layout with `write_embedding_block`, its
                  metadata naming each pair's dataset shard and index, and DIR/provenance.json)
  numpy           LEFT.npy RIGHT.npy, row i of one paired with row i of the other (+ a keys Parquet)
  parquet-embeddings  FILE.parquet ...: a key column and two list<float> embedding columns
  datacomp-npz    DataComp's metadata/HASH.npz (b32_img, b32_txt, l14_img, l14_txt; row i = row i
                  of metadata/HASH.parquet, keyed by its `uid`); a pool root with metadata/ and
                  shards/ also names the pairs the embeddings describe, so later commands find them

A unit (the grain of resume) is a chunk of rows of one array pair (`left.npy#rows=A-B`, an .npz
member pair likewise) or one Parquet row group (`file.parquet#rg=N`). Array rows are read (pread
at the row's offset, after the header was parsed) block by block into reused per-thread buffers,
so resident memory is a few blocks, not the file; Parquet rows come a record batch at a time. The
arithmetic on them (cosines, norms, beta) is `scoring.embeddings`.
"""

from __future__ import annotations

from abc import abstractmethod
import os
import re
import threading
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pairclean.config import check_choice
from pairclean.data.formats.base import REGISTRY, InputFormat, by_priority, format_named, register_format
from pairclean.data.manifest import PAIR_KINDS
from pairclean.data.record import DatasetRecord
from pairclean.data.units import Unit
from pairclean.errors import ConfigError, UserError
from pairclean.ops.notices import notice
from pairclean.ops.records import Json, Record

BLOCK_ROWS = 2048  # rows read at a time into a per-thread buffer (see docs/pair-kinds.md for the measurement)
NPY_DTYPES = (np.float16, np.float32, np.float64)
_CLIP_RETRIEVAL = {"img_emb": "img_emb_", "text_emb": "text_emb_", "metadata": "metadata_"}
SAVED_PROVENANCE = "provenance.json"  # beside img_emb/ when `score --save-embeddings` wrote the directory
UNFINISHED = "unfinished.json"  # beside img_emb/ while a `score --save-embeddings` run is writing the directory
ORIGIN_COLUMNS = ("shard", "index")  # metadata columns naming each row's pair in its dataset (`score --save-embeddings`)


@dataclass
class NpyPair:
    """Two row-aligned arrays stored as .npy data (two .npy files, or two members of one
    uncompressed .npz), + an optional Parquet file holding one key per row."""

    left: str  # the file holding the left array (its path is the rows' `shard`)
    right: str
    rows: int
    dim: int
    dtype: str
    left_offset: int  # where the array's data starts in the file, after the .npy header
    right_offset: int
    keys: str | None = None  # the metadata Parquet (clip-retrieval's metadata_N.parquet, DataComp's, a key file)
    key_column: str | None = None
    origin: bool = False  # the metadata also holds `shard` and `index`: where each row's pair lives in its dataset


@dataclass
class EmbeddingSpec:
    layout: str  # a registered embeddings format: clip-retrieval, numpy, parquet-embeddings, datacomp-npz
    pair: str
    sources: list[str]  # what the user named (a directory, .npy / .npz files, Parquet files)
    npy: list[NpyPair] = field(default_factory=list)
    parquet: list[str] = field(default_factory=list)
    left_field: str | None = None  # the format's default when None
    right_field: str | None = None
    key_field: str | None = None
    dim: int | None = None
    keys_file: str | None = None  # the numpy layout's key Parquet
    pairs: DatasetRecord | None = None  # the dataset of pairs the embeddings describe, when the layout says
    # (DataComp, or the record `score --save-embeddings` kept of the dataset it scored)
    saved: "SavedEmbeddings | None" = None  # DIR/provenance.json of a directory `score --save-embeddings` wrote

    @property
    def input_format(self) -> "EmbeddingFormat":
        return format_named(self.layout, "layout", kind="embeddings")(self)

    def inputs(self) -> list[str]:
        return list(dict.fromkeys([p for n in self.npy for p in (n.left, n.right, n.keys) if p] + list(self.parquet)))

    def units(self, unit_rows: int) -> list[str]:
        """Every unit in output order: row chunks of each array pair, or each Parquet row group."""
        return self.input_format.units(unit_rows)

    def record(self) -> DatasetRecord:
        """What a scores file records about the embeddings it scored (and the pairs they describe)."""
        return DatasetRecord(format=self.layout, sources=[os.path.abspath(s) for s in self.sources], pair=self.pair,
                             fields={"left": self.left_field, "right": self.right_field, "key": self.key_field},
                             key=self.key_field, pairs=self.pairs)


# -- opening ---------------------------------------------------------------------------------


def _npy_header(path: str) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, data offset) of an .npy file whose rows can be read in place."""
    try:
        array = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path} as a .npy array: {str(exc).splitlines()[0][:200]}") from None
    return (*_check_array(path, array.shape, array.dtype, array.flags.c_contiguous or array.ndim < 2), int(array.offset))


def _check_array(path: str, shape, dtype: np.dtype, c_order: bool) -> tuple[tuple[int, ...], np.dtype]:
    if not c_order:
        raise UserError(f"{path} is stored column-major; save it with np.save(path, np.ascontiguousarray(x))")
    if not dtype.isnative:
        raise UserError(f"{path} is stored in non-native byte order ({dtype.str}); convert it with x.astype(x.dtype.newbyteorder('='))")
    return tuple(shape), dtype


def _npz_member(path: str, name: str) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, data offset in the .npz file) of one member array, read in place: the member
    must be stored uncompressed (np.savez, as DataComp's files are)."""
    what = f"{path}[{name}]"
    try:
        with zipfile.ZipFile(path) as archive, open(path, "rb") as fh:
            info = archive.getinfo(f"{name}.npy")
            if info.compress_type != zipfile.ZIP_STORED:
                raise UserError(f"{what} is compressed (np.savez_compressed); rows are read in place only from an "
                                "uncompressed .npz: save it with np.savez")
            fh.seek(info.header_offset + 26)
            name_len, extra_len = (int.from_bytes(fh.read(2), "little") for _ in range(2))
            fh.seek(info.header_offset + 30 + name_len + extra_len)
            data_start = fh.tell()
            version = np.lib.format.read_magic(fh)
            shape, fortran, dtype = (np.lib.format.read_array_header_1_0(fh) if version == (1, 0)
                                     else np.lib.format.read_array_header_2_0(fh))
            offset = fh.tell()
            declared = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            stored = info.file_size - (offset - data_start)
            if declared != stored:  # rows past the stored ones would be read from the next member
                raise UserError(f"{what}'s header declares an array of shape {tuple(shape)} ({declared:,} bytes) but "
                                f"the member stores {stored:,} bytes of data: the file is damaged")
    except KeyError:
        raise UserError(f"{path} has no array {name!r}") from None
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise UserError(f"cannot read {what}: {str(exc).splitlines()[0][:200]}") from None
    return (*_check_array(what, shape, np.dtype(dtype), not fortran or len(shape) < 2), offset)


Array = tuple[str, str, tuple, np.dtype, int]  # (how messages name it, the file, shape, dtype, data offset)


def _npy_pair(left: Array, right: Array, keys: str | None, key_field: str | None,
              key_candidates: tuple[str, ...] = ("key", "image_path")) -> NpyPair:
    (lpath, lfile, lshape, ldtype, loffset), (rpath, rfile, rshape, rdtype, roffset) = left, right
    for path, shape, dtype in ((lpath, lshape, ldtype), (rpath, rshape, rdtype)):
        if len(shape) != 2:
            raise UserError(f"{path} holds an array of shape {shape}; embeddings must be 2-D (rows x dim)")
        if dtype.type not in NPY_DTYPES:
            raise UserError(f"{path} holds {dtype} values; embeddings must be float16, float32 or float64")
    if lshape != rshape:
        raise UserError(f"{lpath} and {rpath} do not pair up: shapes {lshape} and {rshape}")
    if lshape[1] == 0:
        raise UserError(f"{lpath} holds {lshape[0]:,} rows of 0 values: an embedding has at least one value")
    if ldtype != rdtype:
        raise UserError(f"{lpath} ({ldtype}) and {rpath} ({rdtype}) must have the same dtype")
    column, origin = None, False
    if keys is not None:
        try:
            pf = pq.ParquetFile(keys)
        except Exception as exc:
            raise UserError(f"cannot read keys file {keys}: {str(exc).splitlines()[0][:200]}") from None
        names = pf.schema_arrow.names
        candidates = [key_field] if key_field else list(key_candidates)
        column = next((c for c in candidates if c in names), None)
        if column is None:
            raise ConfigError(f"{keys} has no key column ({' or '.join(candidates)}); it has {names}: pass `key_field`",
                              "key_field")
        if pf.metadata.num_rows != lshape[0]:
            raise UserError(f"{keys} has {pf.metadata.num_rows:,} rows but {lpath} has {lshape[0]:,}")
        origin = set(ORIGIN_COLUMNS) <= set(names)
    return NpyPair(lfile, rfile, int(lshape[0]), int(lshape[1]), str(ldtype), loffset, roffset, keys, column, origin)


def _npy_file(path: str) -> Array:
    return (path, path, *_npy_header(path))


def _numbered(directory: Path, prefix: str, suffix: str) -> dict[str, Path]:
    pattern = re.compile(re.escape(prefix) + r"(\d+)" + re.escape(suffix) + "$")
    found = {}
    for path in directory.iterdir() if directory.is_dir() else []:
        match = pattern.match(path.name)
        if match:
            found[match.group(1)] = path
    return found


def _check_parquet(path: str, left_field: str, right_field: str, key_field: str | None) -> None:
    try:
        names = pq.ParquetFile(path).schema_arrow
    except Exception as exc:
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


def _parquet_dim(paths: list[str], column: str) -> int:
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


# -- the layouts -----------------------------------------------------------------------------


class EmbeddingFormat(InputFormat):
    """A layout of precomputed embeddings: `claim` recognises the sources, `open` fills the spec
    (every structural problem a UserError there), `units` and `batches` read it."""

    kind = "embeddings"
    default_fields: ClassVar[tuple[str | None, str | None]] = (None, None)  # (left, right) when not given
    # rows are arrays at fixed offsets (`spec.npy`), readable by position with `NpyFiles` (what dedup needs)
    rows_in_place: ClassVar[bool] = True

    @classmethod
    def claim(cls, sources: list[str], forced: bool = False) -> bool:
        return False

    read = None  # rows come block by block as vectors (`iter_batches`), never as decoded pairs

    @abstractmethod
    def open(self) -> None:
        """Fill the spec from the sources (every structural problem a UserError)."""

    def units(self, unit_rows: int) -> list[str]:
        return [str(Unit.rows(n.left, a, min(a + unit_rows, n.rows))) for n in self.spec.npy
                for a in range(0, n.rows, unit_rows)]

    def batches(self, unit: str, batch_rows: int) -> Iterator["EmbeddingBatch"]:
        parsed = Unit.parse(unit)
        left_path, start, stop = parsed.path, parsed.part.start, parsed.part.stop
        pair = next(n for n in self.spec.npy if n.left == left_path)
        meta = _read_metadata(pair, start, stop)
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

    def describe(self) -> str:
        spec = self.spec
        rows = sum(n.rows for n in spec.npy) if spec.npy else sum(pq.ParquetFile(p).metadata.num_rows
                                                                 for p in spec.parquet)
        files = len(spec.npy) or len(spec.parquet)
        key = spec.key_field or next((n.key_column for n in spec.npy if n.key_column), None) or "none (file/row)"
        pairs = f"; the pairs they describe: {', '.join(spec.pairs.sources)}" if spec.pairs else ""
        return (f"reading {self.label}: left={spec.left_field}, right={spec.right_field} ({spec.dim}-d), key={key}; "
                f"{files} file(s), {rows:,} rows{pairs}")


@register_format
class ClipRetrieval(EmbeddingFormat):
    name = "clip-retrieval"
    label = "clip-retrieval embeddings"
    priority = 10
    default_fields = ("img_emb", "text_emb")

    @classmethod
    def claim(cls, sources: list[str], forced: bool = False) -> bool:
        return len(sources) == 1 and Path(sources[0]).is_dir() and (Path(sources[0]) / "img_emb").is_dir()

    def open(self) -> None:
        spec = self.spec
        if len(spec.sources) != 1 or not Path(spec.sources[0]).is_dir():
            raise UserError("the clip-retrieval layout is one directory holding img_emb/ and text_emb/")
        root = Path(spec.sources[0])
        images = _numbered(root / "img_emb", _CLIP_RETRIEVAL["img_emb"], ".npy")
        texts = _numbered(root / "text_emb", _CLIP_RETRIEVAL["text_emb"], ".npy")
        if (root / UNFINISHED).is_file():
            raise UserError(f"{root} holds the embeddings of an unfinished `pairclean score` run ({len(images)} "
                            "block(s) so far): re-run the command that writes it to finish them before reading them")
        metadata = _numbered(root / "metadata", _CLIP_RETRIEVAL["metadata"], ".parquet")
        if not images:
            raise UserError(f"{root}/img_emb holds no img_emb_N.npy files")
        unmatched = sorted(set(images) ^ set(texts))
        if unmatched:
            raise UserError(f"{root}: img_emb and text_emb files do not pair up (unmatched number {unmatched[0]})")
        spec.saved = read_saved_provenance(root)
        spec.npy = [_npy_pair(_npy_file(str(images[n])), _npy_file(str(texts[n])),
                              str(metadata[n]) if n in metadata else None, spec.key_field)
                    for n in sorted(images, key=int)]
        if spec.saved is not None:  # the pair kind and dataset the saving run scored
            spec.saved.check_blocks(root, {int(n): pair.rows for n, pair in zip(sorted(images, key=int), spec.npy)})
            spec.pair = spec.pair or spec.saved.pair
            spec.pairs = spec.saved.dataset
        elif any(pair.origin for pair in spec.npy):
            notice(f"{root} has no {SAVED_PROVENANCE} but its metadata names each row's shard and index, as "
                   "`pairclean score` writes them: if a run of it wrote this directory, that run did not finish and "
                   "the directory may hold part of the dataset only")


@register_format
class NumpyPair(EmbeddingFormat):
    name = "numpy"
    label = "two .npy arrays"
    priority = 30
    default_fields = ("left", "right")

    @classmethod
    def claim(cls, sources: list[str], forced: bool = False) -> bool:
        return bool(sources) and all(s.endswith(".npy") for s in sources)

    def open(self) -> None:
        spec = self.spec
        if len(spec.sources) != 2:
            raise UserError(f"the numpy layout is two .npy files (left, right), got {len(spec.sources)} path(s)")
        spec.npy = [_npy_pair(_npy_file(spec.sources[0]), _npy_file(spec.sources[1]), spec.keys_file, spec.key_field)]


@register_format
class DataCompNpz(EmbeddingFormat):
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
    def claim(cls, sources: list[str], forced: bool = False) -> bool:
        return bool(sources) and all(s.endswith(".npz") or cls._metadata_dir(s) is not None for s in sources)

    def open(self) -> None:
        spec = self.spec
        files: list[Path] = []
        for source in spec.sources:
            folder = self._metadata_dir(source)
            files.extend(sorted(folder.glob("*.npz")) if folder is not None else [Path(source)])
        spec.npy = []
        for npz in files:
            metadata = npz.with_suffix(".parquet")
            spec.npy.append(_npy_pair((f"{npz}[{spec.left_field}]", str(npz), *_npz_member(str(npz), spec.left_field)),
                                      (f"{npz}[{spec.right_field}]", str(npz), *_npz_member(str(npz), spec.right_field)),
                                      str(metadata) if metadata.is_file() else None, spec.key_field, ("uid",)))
        spec.pairs = self._pairs(files)

    @staticmethod
    def _pairs(files: list[Path]) -> DatasetRecord | None:
        """The pool's shards: `shards/` beside `metadata/`, as download_upstream.py lays the pool out."""
        from pairclean.data.manifest import open_dataset

        roots = {f.parent.parent for f in files if f.parent.name == "metadata"}
        if len(roots) != 1 or not (shards := next(iter(roots)) / "shards").is_dir():
            return None
        try:
            return open_dataset(str(shards)).record()
        except UserError:
            return None


@register_format
class ParquetEmbeddings(EmbeddingFormat):
    name = "parquet-embeddings"
    label = "Parquet embeddings"
    priority = 40
    default_fields = ("left_emb", "right_emb")
    rows_in_place = False  # list columns: a row is found by decoding its page, not at an offset

    @classmethod
    def claim(cls, sources: list[str], forced: bool = False) -> bool:
        return bool(sources) and all(s.endswith(".parquet") or (Path(s).is_dir() and any(Path(s).glob("*.parquet")))
                                     for s in sources)

    def open(self) -> None:
        from pairclean.data.manifest import resolve_shards

        spec = self.spec
        spec.parquet = [s for s in resolve_shards(spec.sources) if s.endswith(".parquet")]
        if not spec.parquet:
            raise UserError(f"no .parquet files in {', '.join(spec.sources)}")
        for path in spec.parquet:
            _check_parquet(path, spec.left_field, spec.right_field, spec.key_field)

    def units(self, unit_rows: int) -> list[str]:
        return [str(Unit.row_group(path, i)) for path in self.spec.parquet
                for i in range(max(pq.ParquetFile(path).num_row_groups, 1))]

    def batches(self, unit: str, batch_rows: int) -> Iterator["EmbeddingBatch"]:
        spec = self.spec
        parsed = Unit.parse(unit)
        path, rg = parsed.path, parsed.part
        pf = pq.ParquetFile(path)
        if pf.num_row_groups == 0:
            return
        offset = sum(pf.metadata.row_group(i).num_rows for i in range(rg))
        columns = [spec.left_field, spec.right_field] + ([spec.key_field] if spec.key_field else [])
        for batch in pf.iter_batches(batch_size=batch_rows, row_groups=[rg], columns=columns):
            left, bad = _list_column(batch.column(spec.left_field), spec.dim, "left")
            right, bad_right = _list_column(batch.column(spec.right_field), spec.dim, "right")
            for i, reason in bad_right.items():
                bad.setdefault(i, reason)
            keys = pc.cast(batch.column(spec.key_field), pa.string()) if spec.key_field else None
            yield EmbeddingBatch(path, np.arange(offset, offset + batch.num_rows, dtype=np.int64), keys,
                                 ArrayRows(left, right), bad)
            offset += batch.num_rows


@dataclass(frozen=True)
class SavedBeta(Record):
    """The beta of the run that saved the embeddings (`core.beta.BetaEstimate`'s fields)."""

    what = "saved beta"
    mode: str
    beta: float
    std: float | None = None
    k: int | None = None
    seed: int | None = None


@dataclass(frozen=True)
class SavedBlock(Record):
    what = "saved block"
    unit: str  # the unit whose rows block N holds
    rows: int


@dataclass(frozen=True)
class SavedEmbeddings(Record):
    """DIR/provenance.json: what `score --save-embeddings` recorded beside the embeddings, written
    when every unit is committed (its presence marks the directory complete, `blocks` what it holds)."""

    what = "saved-embeddings provenance"
    written_by: str
    pair: str
    rows: int
    blocks: dict[str, SavedBlock]
    beta: SavedBeta
    estimator: dict[str, Json] | None = None  # the backend's own provenance
    pairclean_version: str | None = None
    weights_sha1: str | None = None
    preprocessing: str | None = None
    img_emb: str | None = None  # the modality of each side
    text_emb: str | None = None
    dtype: str | None = None
    normalised: bool | None = None
    bytes: int | None = None
    dataset: DatasetRecord | None = None  # the dataset scored, with its files' fingerprints
    input_shards: list[str] | None = None

    def problems(self):
        if self.pair not in PAIR_KINDS:
            yield "pair", f"must be one of {', '.join(PAIR_KINDS)}, got {self.pair!r}"
        for name in ("rows", "bytes"):
            if (getattr(self, name) or 0) < 0:
                yield name, f"must be 0 or more, got {getattr(self, name)}"
        for number, block in self.blocks.items():
            if not number.isdigit() or block.rows < 0:
                yield f"blocks.{number}", "must be a block number holding 0 rows or more"

    def check_blocks(self, root: Path, held: dict[int, int]) -> None:
        """The directory holds the blocks this record lists, each with its rows, and no other."""
        listed = {int(n): block.rows for n, block in self.blocks.items()}
        where = root / SAVED_PROVENANCE
        for number in sorted(listed.keys() | held.keys()):
            if number not in held:
                raise UserError(f"{where} lists block {number} ({listed[number]:,} rows) but {root} does not hold it: "
                                "the directory is not whole; save the embeddings again")
            if number not in listed:
                raise UserError(f"{root} holds block {number}, which {where} does not list: blocks of another run?")
            if held[number] != listed[number]:
                raise UserError(f"block {number} of {root} holds {held[number]:,} rows, {where} says "
                                f"{listed[number]:,}")
        if sum(listed.values()) != self.rows:
            raise UserError(f"{where} says rows {self.rows:,} but its blocks hold {sum(listed.values()):,}")


def read_saved_provenance(directory: str | Path) -> SavedEmbeddings | None:
    """What `score --save-embeddings` recorded beside the embeddings (None: another tool wrote them)."""
    path = Path(directory) / SAVED_PROVENANCE
    return SavedEmbeddings.read(path) if path.is_file() else None


def detect_layout(sources: list[str]) -> str:
    for cls in by_priority("embeddings"):
        if cls.claim(sources):
            return cls.name
    raise ConfigError("cannot tell the embeddings layout of " + ", ".join(sources) + ": give a clip-retrieval "
                      "output directory (img_emb/, text_emb/, metadata/), two .npy files (left, right), DataComp's "
                      "metadata/ (.npz beside .parquet), or Parquet files with two embedding columns (or pass `layout`)",
                      "layout")


def open_embeddings(sources: str | list[str], layout: str = "auto", pair: str | None = None,
                    left_field: str | None = None, right_field: str | None = None, key_field: str | None = None,
                    keys: str | None = None) -> EmbeddingSpec:
    """Resolve and check an embeddings input; every structural problem is a UserError here."""
    sources = [sources] if isinstance(sources, str) else list(sources)
    for s in sources:
        if not Path(s).exists():
            raise UserError(f"path not found: {s}")
    check_choice(layout, ("auto", *(n for n, c in REGISTRY.items() if c.kind == "embeddings")), "layout")
    layout = detect_layout(sources) if layout == "auto" else layout
    if pair is not None:
        check_choice(pair, PAIR_KINDS, "pair")
    if keys is not None and layout != NumpyPair.name:
        raise ConfigError("`keys` names the key file of the numpy layout (LEFT.npy RIGHT.npy); "
                          "clip-retrieval and DataComp keys come from their metadata, Parquet keys from `key_field`",
                          "keys", "key_field")
    cls = REGISTRY[layout]
    spec = EmbeddingSpec(layout=layout, pair=pair, sources=sources,
                         left_field=left_field or cls.default_fields[0], right_field=right_field or cls.default_fields[1],
                         key_field=key_field, keys_file=keys)
    spec.input_format.open()
    spec.pair = spec.pair or "image-text"  # unless the layout recorded it (a directory `score --save-embeddings` wrote)
    dims = {n.dim for n in spec.npy} if spec.npy else {_parquet_dim(spec.parquet, spec.left_field)}
    if len(dims) > 1:
        raise UserError(f"the embedding files have different dimensions: {sorted(dims)}")
    spec.dim = dims.pop() if dims else None
    if spec.key_field is None:
        spec.key_field = next((n.key_column for n in spec.npy if n.key_column), None)
    return spec


# -- reading batches ---------------------------------------------------------------------------

_buffers = threading.local()  # per-thread, reused block buffers: no allocation, no page faults


def block_buffer(slot: str, dtype: np.dtype, dim: int) -> np.ndarray:
    """A per-thread buffer of BLOCK_ROWS rows, reused for every block read into (or converted in) this slot."""
    cache = _buffers.__dict__.setdefault("arrays", {})
    key = (slot, dtype.str, dim, BLOCK_ROWS)
    if key not in cache:
        cache[key] = np.empty((BLOCK_ROWS, dim), dtype=dtype)
    return cache[key]


class ArrayRows:
    """Row pairs already in memory (a Parquet batch)."""

    def __init__(self, left: np.ndarray, right: np.ndarray):
        self.left, self.right = left, right

    def __len__(self) -> int:
        return len(self.left)

    def block(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        return self.left[a:b], self.right[a:b]

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return self.left, self.right


class NpyFiles:
    """The two open files of an .npy pair, read with pread at row offsets (thread-safe, no seek).

    Reading rather than mapping keeps resident memory to the blocks being scored and avoids one
    page fault per 4 kB: a block lands in a reused buffer that stays in cache while it is scored.
    """

    def __init__(self, pair: NpyPair):
        self.dtype, self.dim = np.dtype(pair.dtype), pair.dim
        self.row_bytes = self.dim * self.dtype.itemsize
        self.offsets = [pair.left_offset, pair.right_offset]
        self.paths = [pair.left, pair.right]
        self.fds: list[int] = []
        try:
            for path in self.paths:
                self.fds.append(os.open(path, os.O_RDONLY))
        except OSError:
            self.close()
            raise

    def read(self, side: int, row: int, out: np.ndarray) -> None:
        view = memoryview(out).cast("B")
        offset = self.offsets[side] + row * self.row_bytes
        while len(view):
            if hasattr(os, "preadv"):
                n = os.preadv(self.fds[side], [view], offset)
            else:
                data = os.pread(self.fds[side], len(view), offset)
                n = len(data)
                view[:n] = data
            if n == 0:
                raise OSError(f"{self.paths[side]} ended early: rows {row}..{row + len(out) - 1} are not all there")
            view, offset = view[n:], offset + n

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


class NpyRows:
    """Rows [start, stop) of an .npy pair, read block by block into per-thread buffers."""

    def __init__(self, files: NpyFiles, start: int, stop: int):
        self.files, self.start, self.stop = files, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def block(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        out = []
        for side, slot in ((0, "raw-left"), (1, "raw-right")):
            buf = block_buffer(slot, self.files.dtype, self.files.dim)[:b - a]
            self.files.read(side, self.start + a, buf)
            out.append(buf)
        return out[0], out[1]

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return self.array(0), self.array(1)

    def array(self, side: int) -> np.ndarray:
        """One side's rows (0: left, 1: right), read whole into a new array."""
        array = np.empty((len(self), self.files.dim), dtype=self.files.dtype)
        self.files.read(side, self.start, array)
        return array


@dataclass
class EmbeddingBatch:
    shard: str
    index: np.ndarray  # row numbers within `shard`
    keys: pa.Array | None
    rows: ArrayRows | NpyRows
    bad: dict[int, str] = field(default_factory=dict)  # row position -> reason it has no usable vector
    origin: tuple[pa.Array, pa.Array] | None = None  # (shard, index) of each row's pair in its dataset, if recorded

    def identity(self) -> tuple[pa.Array, pa.Array, np.ndarray]:
        """(key, shard, index) of every row, as the scores file names the pair: where the metadata
        records the pair's dataset shard and index (`score --save-embeddings`), those, so scores
        computed again from the embeddings join the first run's and its truth; else the embedding
        file and the row in it, and `<file stem>/<row>` for a missing key."""
        keys = self.keys if self.keys is not None else _default_keys(self.shard, self.index)
        if self.origin is not None:
            return keys, self.origin[0], self.origin[1].to_numpy(zero_copy_only=False)
        return keys, pa.repeat(self.shard, len(self.index)), self.index


def _default_keys(shard: str, index: np.ndarray) -> pa.Array:
    """`<file stem>/<row>` for rows without a key file."""
    return pc.binary_join_element_wise(Path(shard).stem, pc.cast(pa.array(index), pa.string()), "/")


def _read_metadata(pair: NpyPair, start: int, stop: int) -> pa.Table | None:
    """The key (and origin) columns of rows [start, stop) from the pair's metadata file, reading
    only the row groups they span."""
    if pair.keys is None:
        return None
    pf = pq.ParquetFile(pair.keys)
    groups, first, offset = [], None, 0
    for i in range(pf.num_row_groups):
        n = pf.metadata.row_group(i).num_rows
        if offset + n > start and offset < stop:
            groups.append(i)
            first = offset if first is None else first
        offset += n
    columns = [pair.key_column, *(ORIGIN_COLUMNS if pair.origin else ())]
    table = pf.read_row_groups(groups, columns=columns).slice(start - first, stop - start)
    return pa.table([pc.cast(table.column(0), pa.string()),
                     *([pc.cast(table.column(1), pa.string()), pc.cast(table.column(2), pa.int64())]
                       if pair.origin else [])],
                    names=["key", *(ORIGIN_COLUMNS if pair.origin else ())])


def _list_column(column: pa.Array, dim: int, what: str) -> tuple[np.ndarray, dict[int, str]]:
    """(rows x dim float array, bad rows) from a list<float> column; a null or wrongly sized list
    becomes a bad row (zeros in the array)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    nulls = column.is_null().to_numpy(zero_copy_only=False)
    good = ~nulls & (np.nan_to_num(lengths, nan=-1) == dim)
    out = np.zeros((len(column), dim), dtype=np.float32)
    if good.all():
        out[:] = column.flatten().to_numpy(zero_copy_only=False).reshape(len(column), dim)
    elif good.any():
        kept = column.filter(pa.array(good))
        out[good] = kept.flatten().to_numpy(zero_copy_only=False).reshape(int(good.sum()), dim)
    bad = {int(i): (f"missing {what} embedding" if nulls[i] else
                    f"{what} embedding has {int(lengths[i])} values, expected {dim}") for i in np.flatnonzero(~good)}
    return out, bad


def iter_batches(spec: EmbeddingSpec, unit: str, batch_rows: int) -> Iterator[EmbeddingBatch]:
    """The unit's rows in batches of at most `batch_rows`, as the layout reads them."""
    return spec.input_format.batches(unit, batch_rows)


def write_embedding_block(directory: str | Path, number: int, left: np.ndarray, right: np.ndarray,
                          metadata: pa.Table | None = None, temp_dir: str | Path | None = None) -> int:
    """Write block `number` of clip-retrieval's layout under `directory` (img_emb/img_emb_N.npy,
    text_emb/text_emb_N.npy, metadata/metadata_N.parquet): row-aligned left / right vectors and
    their metadata (key, and `shard`, `index` where the pairs' dataset is known). Each file is
    written under a temp name and renamed into place, so a block is rewritten whole or not at all;
    the bytes written. The one writer of the layout (`write_embeddings`, `score --save-embeddings`)."""
    from pairclean.ops.atomic import atomic_path

    directory = Path(directory)
    if left.shape != right.shape or left.ndim != 2:
        raise UserError(f"left {left.shape} and right {right.shape} must be the same 2-D shape")
    if metadata is not None and metadata.num_rows != len(left):
        raise UserError(f"metadata holds {metadata.num_rows} rows for {len(left)} embeddings")
    written = 0
    for sub, array in (("img_emb", left), ("text_emb", right)):
        (directory / sub).mkdir(parents=True, exist_ok=True)
        with atomic_path(directory / sub / f"{_CLIP_RETRIEVAL[sub]}{number}.npy", temp_dir=temp_dir) as path:
            with open(path, "wb") as fh:
                np.save(fh, array)
            written += path.stat().st_size
    if metadata is not None:
        (directory / "metadata").mkdir(parents=True, exist_ok=True)
        with atomic_path(directory / "metadata" / f"{_CLIP_RETRIEVAL['metadata']}{number}.parquet",
                         temp_dir=temp_dir) as path:
            pq.write_table(metadata, path)
            written += path.stat().st_size
    return written


def write_embeddings(directory: str | Path, chunks: Iterable[tuple[np.ndarray, np.ndarray, list[str] | None]],
                     overwrite: bool = False) -> Path:
    """Write row-aligned (left, right, keys) chunks in clip-retrieval's layout, one numbered block
    per chunk (benchmarks and tests use it; so can users handing their own arrays to
    `pairclean score --from-embeddings`). Chunks are written as they come: memory is one chunk."""
    from pairclean.ops.guard import open_output

    target = open_output(directory, (), "out", kind="directory", overwrite=overwrite)
    with target.stage() as tmp:
        for sub in _CLIP_RETRIEVAL:
            (tmp / sub).mkdir()
        for number, (left, right, keys) in enumerate(chunks):
            write_embedding_block(tmp, number, left, right,
                                  pa.table({"key": pa.array(keys, pa.string())}) if keys is not None else None)
    return target.path
