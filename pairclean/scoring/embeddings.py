"""Scoring from precomputed embeddings: no model and no GPU, the same parts, finalize and output.

Layouts (`open_embeddings`):
  clip-retrieval  DIR/img_emb/img_emb_N.npy + DIR/text_emb/text_emb_N.npy (+ DIR/metadata/metadata_N.parquet)
  numpy           LEFT.npy RIGHT.npy, row i of one paired with row i of the other (+ --keys KEYS.parquet)
  parquet         FILE.parquet ...: a key column and two list<float> embedding columns

A unit (the grain of resume) is a chunk of rows of one .npy pair (`left.npy#rows=A-B`) or one
Parquet row group (`file.parquet#rg=N`). .npy rows are read (pread at the row's offset, after
the header np.load(mmap_mode="r") parsed) block by block into reused per-thread buffers, so
resident memory is a few blocks, not the file, and a block is scored while it is in cache;
Parquet rows come a record batch at a time.

The similarity is the cosine: the row-wise dot divided by both norms, which are computed anyway
to check that the vectors are unit length (a user may hand over unnormalised ones) and to turn
zero or non-finite vectors into error rows. beta cannot come from a model here: it is given
(`fixed`), computed from embeddings of random inputs that the user supplies (`random-inputs`),
or the shuffled-pairs diagnostic.
"""

from __future__ import annotations

import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from pairclean.config import COUNT, at_least, check_choice, setting, unpinned
from pairclean.core.beta import BETA_MODES, BetaEstimate, ShuffledAccumulator
from pairclean.core.scorer import null_partners
from pairclean.data.manifest import PAIR_KINDS
from pairclean.data.units import Unit
from pairclean.errors import ConfigError, UserError
from pairclean.ops.guard import Output, open_output
from pairclean.ops.notices import notice
from pairclean.scoring.run import Commit, Producer, RunConfig, ScoreResult, Work, run_scoring

LAYOUTS = ("clip-retrieval", "numpy", "parquet")
UNIT_TOLERANCE = 1e-2  # |norm - 1| above this is "not unit length" (float16 storage rounds to ~1e-3)
BLOCK_ROWS = 2048  # rows read and scored at a time (see docs/pair-kinds.md for the measurement)
NULL_PER_BATCH = 4096  # rows per batch (evenly spaced) that draw a null pair: bounds the extra dot products
JOB_ROWS = 16384  # rows per thread-pool job (a run of blocks)
NPY_DTYPES = (np.float16, np.float32, np.float64)
_CLIP_RETRIEVAL = {"img_emb": "img_emb_", "text_emb": "text_emb_", "metadata": "metadata_"}


@dataclass
class NpyPair:
    """Two row-aligned .npy files (+ an optional Parquet file holding one key per row)."""

    left: str
    right: str
    rows: int
    dim: int
    dtype: str
    left_offset: int  # where the data starts, after the .npy header
    right_offset: int
    keys: str | None = None
    key_column: str | None = None


@dataclass
class EmbeddingSpec:
    layout: str
    pair: str
    sources: list[str]  # what the user named (a directory, .npy files, Parquet files)
    npy: list[NpyPair] = field(default_factory=list)
    parquet: list[str] = field(default_factory=list)
    left_field: str = "left_emb"
    right_field: str = "right_emb"
    key_field: str | None = None
    dim: int | None = None

    def inputs(self) -> list[str]:
        return [p for n in self.npy for p in (n.left, n.right, n.keys) if p] + list(self.parquet)

    def units(self, unit_rows: int) -> list[str]:
        """Every unit in output order: row chunks of each .npy pair, or each Parquet row group."""
        if self.layout == "parquet":
            return [str(Unit.row_group(path, i)) for path in self.parquet
                    for i in range(max(pq.ParquetFile(path).num_row_groups, 1))]
        return [str(Unit.rows(n.left, a, min(a + unit_rows, n.rows))) for n in self.npy for a in range(0, n.rows, unit_rows)]


# -- opening the layouts ---------------------------------------------------------------------


def _npy_header(path: str) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, data offset) of an .npy file whose rows can be read in place."""
    try:
        array = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path} as a .npy array: {str(exc).splitlines()[0][:200]}") from None
    if array.ndim == 2 and not array.flags.c_contiguous:
        raise UserError(f"{path} is stored column-major; save it with np.save(path, np.ascontiguousarray(x))")
    if not array.dtype.isnative:
        raise UserError(f"{path} is stored in non-native byte order ({array.dtype.str}); convert it with x.astype(x.dtype.newbyteorder('='))")
    return array.shape, array.dtype, int(array.offset)


def _npy_pair(left: str, right: str, keys: str | None, key_field: str | None) -> NpyPair:
    (lshape, ldtype, loffset), (rshape, rdtype, roffset) = _npy_header(left), _npy_header(right)
    for path, shape, dtype in ((left, lshape, ldtype), (right, rshape, rdtype)):
        if len(shape) != 2:
            raise UserError(f"{path} holds an array of shape {shape}; embeddings must be 2-D (rows x dim)")
        if dtype.type not in NPY_DTYPES:
            raise UserError(f"{path} holds {dtype} values; embeddings must be float16, float32 or float64")
    if lshape != rshape:
        raise UserError(f"{left} and {right} do not pair up: shapes {lshape} and {rshape}")
    if ldtype != rdtype:
        raise UserError(f"{left} ({ldtype}) and {right} ({rdtype}) must have the same dtype")
    column = None
    if keys is not None:
        try:
            pf = pq.ParquetFile(keys)
        except Exception as exc:
            raise UserError(f"cannot read keys file {keys}: {str(exc).splitlines()[0][:200]}") from None
        names = pf.schema_arrow.names
        candidates = [key_field] if key_field else ["key", "image_path"]
        column = next((c for c in candidates if c in names), None)
        if column is None:
            raise ConfigError(f"{keys} has no key column ({' or '.join(candidates)}); it has {names}: pass `key_field`",
                              "key_field")
        if pf.metadata.num_rows != lshape[0]:
            raise UserError(f"{keys} has {pf.metadata.num_rows:,} rows but {left} has {lshape[0]:,}")
    return NpyPair(left, right, int(lshape[0]), int(lshape[1]), str(ldtype), loffset, roffset, keys, column)


def _numbered(directory: Path, prefix: str, suffix: str) -> dict[str, Path]:
    pattern = re.compile(re.escape(prefix) + r"(\d+)" + re.escape(suffix) + "$")
    found = {}
    for path in directory.iterdir() if directory.is_dir() else []:
        match = pattern.match(path.name)
        if match:
            found[match.group(1)] = path
    return found


def _clip_retrieval(root: Path, key_field: str | None) -> list[NpyPair]:
    images = _numbered(root / "img_emb", _CLIP_RETRIEVAL["img_emb"], ".npy")
    texts = _numbered(root / "text_emb", _CLIP_RETRIEVAL["text_emb"], ".npy")
    metadata = _numbered(root / "metadata", _CLIP_RETRIEVAL["metadata"], ".parquet")
    if not images:
        raise UserError(f"{root}/img_emb holds no img_emb_N.npy files")
    unmatched = sorted(set(images) ^ set(texts))
    if unmatched:
        raise UserError(f"{root}: img_emb and text_emb files do not pair up (unmatched number {unmatched[0]})")
    order = sorted(images, key=int)
    return [_npy_pair(str(images[n]), str(texts[n]), str(metadata[n]) if n in metadata else None, key_field)
            for n in order]


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
            if len(lengths):
                return int(lengths[0].as_py())
    raise UserError(f"column {column!r} holds no embedding in {', '.join(paths)}")


def detect_layout(sources: list[str]) -> str:
    if len(sources) == 1 and Path(sources[0]).is_dir() and (Path(sources[0]) / "img_emb").is_dir():
        return "clip-retrieval"
    if sources and all(s.endswith(".npy") for s in sources):
        return "numpy"
    if sources and all(s.endswith(".parquet") or (Path(s).is_dir() and any(Path(s).glob("*.parquet")))
                       for s in sources):
        return "parquet"
    raise ConfigError("cannot tell the embeddings layout of " + ", ".join(sources) + ": give a clip-retrieval "
                      "output directory (img_emb/, text_emb/, metadata/), two .npy files (left, right), "
                      "or Parquet files with two embedding columns (or pass `layout`)", "layout")


def open_embeddings(sources: str | list[str], layout: str = "auto", pair: str | None = None,
                    left_field: str = "left_emb", right_field: str = "right_emb", key_field: str | None = None,
                    keys: str | None = None) -> EmbeddingSpec:
    """Resolve and check an embeddings input; every structural problem is a UserError here."""
    from pairclean.data.manifest import resolve_shards

    sources = [sources] if isinstance(sources, str) else list(sources)
    for s in sources:
        if not Path(s).exists():
            raise UserError(f"path not found: {s}")
    check_choice(layout, ("auto", *LAYOUTS), "layout")
    layout = detect_layout(sources) if layout == "auto" else layout
    if pair is not None:
        check_choice(pair, PAIR_KINDS, "pair")
    if keys is not None and layout != "numpy":
        raise ConfigError("`keys` names the key file of the numpy layout (LEFT.npy RIGHT.npy); "
                          "clip-retrieval keys come from metadata/, Parquet keys from `key_field`", "keys", "key_field")
    spec = EmbeddingSpec(layout=layout, pair=pair or "image-text", sources=sources, left_field=left_field, right_field=right_field,
                         key_field=key_field)
    if layout == "clip-retrieval":
        if len(sources) != 1 or not Path(sources[0]).is_dir():
            raise UserError("the clip-retrieval layout is one directory holding img_emb/ and text_emb/")
        spec.npy = _clip_retrieval(Path(sources[0]), key_field)
    elif layout == "numpy":
        if len(sources) != 2:
            raise UserError(f"the numpy layout is two .npy files (left, right), got {len(sources)} path(s)")
        spec.npy = [_npy_pair(sources[0], sources[1], keys, key_field)]
    else:
        spec.parquet = [s for s in resolve_shards(sources) if s.endswith(".parquet")]
        if not spec.parquet:
            raise UserError(f"no .parquet files in {', '.join(sources)}")
        for path in spec.parquet:
            _check_parquet(path, left_field, right_field, key_field)
    dims = {n.dim for n in spec.npy} if spec.npy else {_parquet_dim(spec.parquet, left_field)}
    if len(dims) > 1:
        raise UserError(f"the embedding files have different dimensions: {sorted(dims)}")
    spec.dim = dims.pop() if dims else None
    return spec


# -- reading batches ---------------------------------------------------------------------------

_buffers = threading.local()  # per-thread, reused block buffers: no allocation, no page faults


def _buffer(slot: str, dtype: np.dtype, dim: int) -> np.ndarray:
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
            buf = _buffer(slot, self.files.dtype, self.files.dim)[:b - a]
            self.files.read(side, self.start + a, buf)
            out.append(buf)
        return out[0], out[1]

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        out = []
        for side in (0, 1):
            array = np.empty((len(self), self.files.dim), dtype=self.files.dtype)
            self.files.read(side, self.start, array)
            out.append(array)
        return out[0], out[1]


@dataclass
class EmbeddingBatch:
    shard: str
    index: np.ndarray  # row numbers within `shard`
    keys: pa.Array | None
    rows: ArrayRows | NpyRows
    bad: dict[int, str] = field(default_factory=dict)  # row position -> reason it has no usable vector


def _read_keys(pair: NpyPair, start: int, stop: int) -> pa.Array | None:
    """Keys of rows [start, stop) from the pair's key file, reading only the row groups they span."""
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
    table = pf.read_row_groups(groups, columns=[pair.key_column])
    return pc.cast(table.column(0).combine_chunks().slice(start - first, stop - start), pa.string())


def _npy_batches(spec: EmbeddingSpec, unit: str, batch_rows: int) -> Iterator[EmbeddingBatch]:
    parsed = Unit.parse(unit)
    left_path, start, stop = parsed.path, parsed.part.start, parsed.part.stop
    pair = next(n for n in spec.npy if n.left == left_path)
    keys = _read_keys(pair, start, stop)
    files = NpyFiles(pair)
    try:
        for a in range(start, stop, batch_rows):
            b = min(a + batch_rows, stop)
            yield EmbeddingBatch(pair.left, np.arange(a, b, dtype=np.int64),
                                 keys.slice(a - start, b - a) if keys is not None else None, NpyRows(files, a, b))
    finally:
        files.close()


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


def _parquet_batches(spec: EmbeddingSpec, unit: str, batch_rows: int) -> Iterator[EmbeddingBatch]:
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


def iter_batches(spec: EmbeddingSpec, unit: str, batch_rows: int) -> Iterator[EmbeddingBatch]:
    if spec.layout == "parquet":
        return _parquet_batches(spec, unit, batch_rows)
    return _npy_batches(spec, unit, batch_rows)


# -- the arithmetic ----------------------------------------------------------------------------


def _as_float32(block: np.ndarray, slot: str) -> np.ndarray:
    """The block as float32: itself, or converted into a reused per-thread buffer."""
    if block.dtype == np.float32:
        return block
    view = torch.from_numpy(_buffer(slot, np.dtype(np.float32), block.shape[1])[:len(block)])
    view.copy_(torch.from_numpy(block))  # torch converts float16 with F16C; numpy's cast is several times slower
    return view.numpy()


def _job(rows: ArrayRows | NpyRows, start: int, stop: int, out: np.ndarray) -> None:
    """Rows [start, stop), one cache-sized block at a time: read, convert, three row-wise dots."""
    for a in range(start, stop, BLOCK_ROWS):
        b = min(a + BLOCK_ROWS, stop)
        left, right = rows.block(a, b)
        u, v = _as_float32(left, "f32-left"), _as_float32(right, "f32-right")
        np.einsum("ij,ij->i", u, v, out=out[0, a:b])
        np.einsum("ij,ij->i", u, u, out=out[1, a:b])
        np.einsum("ij,ij->i", v, v, out=out[2, a:b])


def row_products(rows: ArrayRows | NpyRows, pool: ThreadPoolExecutor | None) -> np.ndarray:
    """3 x n float32: u.v, u.u and v.v row by row (numpy and torch release the GIL: the pool's
    threads run in parallel)."""
    n = len(rows)
    out = np.empty((3, n), dtype=np.float32)
    jobs = [(a, min(a + JOB_ROWS, n)) for a in range(0, n, JOB_ROWS)]
    if pool is None:
        for a, b in jobs:
            _job(rows, a, b, out)
    else:
        list(pool.map(lambda job: _job(rows, job[0], job[1], out), jobs))
    return out


@dataclass
class BatchScores:
    sim: np.ndarray  # float32, NaN where the row has no score
    null_sim: np.ndarray  # float32: the null sample's values on the rows that drew one, NaN elsewhere
    error: list[str | None]
    not_unit_left: int
    not_unit_right: int
    max_deviation: float


def score_batch(batch: EmbeddingBatch, pool: ThreadPoolExecutor | None,
                accumulator: ShuffledAccumulator | None = None) -> BatchScores:
    """Cosine of each row pair; zero, non-finite or missing vectors become error rows."""
    dot, nu2, nv2 = row_products(batch.rows, pool)
    nu, nv = np.sqrt(nu2), np.sqrt(nv2)
    with np.errstate(divide="ignore", invalid="ignore"):
        sim = dot / (nu * nv)
    usable = np.isfinite(sim) & (nu > 0) & (nv > 0)
    if batch.bad:
        usable[list(batch.bad)] = False
    sim = np.where(usable, sim, np.nan).astype(np.float32)
    error: list[str | None] = [None] * len(sim)
    for i in np.flatnonzero(~usable).tolist():
        error[i] = batch.bad.get(i) or ("zero-length embedding" if (nu[i] == 0 or nv[i] == 0)
                                        else "non-finite embedding")
    null_sim = np.full(len(sim), np.nan, dtype=np.float32)
    drawn = np.flatnonzero(usable)[::max(1, -(-int(usable.sum()) // NULL_PER_BATCH))]
    if len(drawn) >= 2:
        left, right = batch.rows.arrays()
        partner = drawn[null_partners(len(drawn))]
        u = np.asarray(left[drawn], dtype=np.float64) / nu[drawn, None]
        v = np.asarray(right[partner], dtype=np.float64) / nv[partner, None]
        null_sim[drawn] = (u * v).sum(1)
    dev_u, dev_v = np.abs(nu[usable] - 1), np.abs(nv[usable] - 1)
    if accumulator is not None and usable.any():
        rows = np.flatnonzero(usable)
        left, right = batch.rows.arrays()
        u = torch.from_numpy(np.asarray(left[rows], dtype=np.float64) / nu[rows, None])
        v = torch.from_numpy(np.asarray(right[rows], dtype=np.float64) / nv[rows, None])
        accumulator.add(u, v)
    return BatchScores(sim, null_sim, error, int((dev_u > UNIT_TOLERANCE).sum()), int((dev_v > UNIT_TOLERANCE).sum()),
                       float(max(dev_u.max(initial=0.0), dev_v.max(initial=0.0))))


# -- beta ----------------------------------------------------------------------------------------


def _unit_vectors(spec: EmbeddingSpec, side: str, batch_rows: int) -> Iterator[np.ndarray]:
    """One side's usable vectors, normalised, in float64 batches."""
    for unit in spec.units(1 << 62):
        for batch in iter_batches(spec, unit, batch_rows):
            x = np.asarray(batch.rows.arrays()[side == "right"], dtype=np.float64)
            norms = np.linalg.norm(x, axis=1)
            keep = np.isfinite(norms) & (norms > 0)
            if batch.bad:
                keep[list(batch.bad)] = False
            yield x[keep] / norms[keep, None]


def random_embeddings_beta(spec: EmbeddingSpec, batch_rows: int = 65536) -> BetaEstimate:
    """beta = mean cosine over all K_left x K_right pairs of user-supplied random-input embeddings.

    Streamed exactly, without the K x K matrix: mean = (sum u^).(sum v^) / (K_l K_r) and
    E[s^2] = sum_i u^_i' M u^_i / (K_l K_r) with M = sum_j v^_j v^_j' (d x d).
    """
    dim = spec.dim or 0
    sum_v, m, k_right = np.zeros(dim), np.zeros((dim, dim)), 0
    for v in _unit_vectors(spec, "right", batch_rows):
        sum_v += v.sum(0)
        m += v.T @ v
        k_right += len(v)
    sum_u, sq, k_left = np.zeros(dim), 0.0, 0
    for u in _unit_vectors(spec, "left", batch_rows):
        sum_u += u.sum(0)
        sq += float(((u @ m) * u).sum())
        k_left += len(u)
    if k_left < 2 or k_right < 2:
        raise UserError(f"the random-input embeddings hold {k_left} usable left and {k_right} right vectors; "
                        "beta needs at least 2 of each (1024 or more is the default)")
    n = k_left * k_right
    mean = float(sum_u @ sum_v) / n
    var = max(sq / n - mean * mean, 0.0) * n / (n - 1)
    return BetaEstimate("random-inputs", mean, float(np.sqrt(var)), min(k_left, k_right))


# -- the producer --------------------------------------------------------------------------------


@dataclass
class EmbeddingScoreConfig(RunConfig):
    random_embeddings: EmbeddingSpec | None = unpinned(None)  # for beta_mode random-inputs (pinned by its paths)
    batch_rows: int = setting(65536, COUNT, pinned=False)  # rows read at a time: what bounds memory
    unit_rows: int = setting(1 << 18, COUNT)  # rows per unit of an .npy pair: the grain of resume; held until commit
    threads: int = setting(0, at_least(0), pinned=False)  # 0: torch.get_num_threads()

    def __post_init__(self):
        super().__post_init__()
        if self.beta_mode != "random-inputs" and self.random_embeddings is not None:
            raise ConfigError(f"random_embeddings is only used with beta_mode random-inputs, not {self.beta_mode}",
                              "random_embeddings", "beta_mode")


def _default_keys(shard: str, index: np.ndarray) -> pa.Array:
    """`<file stem>/<row>` for rows without a key file."""
    return pc.binary_join_element_wise(Path(shard).stem, pc.cast(pa.array(index), pa.string()), "/")


def _score_unit(unit: str, spec: EmbeddingSpec, batch_rows: int, pool: ThreadPoolExecutor | None,
                shuffled: bool) -> tuple[dict, dict]:
    """Score one unit batch by batch: (its part's columns, its commit record). A unit that breaks
    keeps its rows so far and says why in the record."""
    keys, shards, index, sims, nulls, errors = [], [], [], [], [], []
    not_unit = [0, 0]
    deviation = 0.0
    accumulator = ShuffledAccumulator() if shuffled else None
    failure = None
    try:
        for batch in iter_batches(spec, unit, batch_rows):
            scores = score_batch(batch, pool, accumulator)
            keys.append(batch.keys if batch.keys is not None else _default_keys(batch.shard, batch.index))
            shards.append(pa.repeat(batch.shard, len(batch.index)))
            index.append(batch.index)
            sims.append(scores.sim)
            nulls.append(scores.null_sim)
            errors.extend(scores.error)
            not_unit[0] += scores.not_unit_left
            not_unit[1] += scores.not_unit_right
            deviation = max(deviation, scores.max_deviation)
    except (OSError, ValueError) as exc:  # a file that vanished or broke mid-run: keep what was read
        failure = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    columns = {"key": pa.concat_arrays(keys) if keys else pa.array([], pa.string()),
               "shard": pa.concat_arrays(shards) if shards else pa.array([], pa.string()),
               "index": np.concatenate(index) if index else np.array([], np.int64),
               "sim": np.concatenate(sims) if sims else np.array([], np.float32),
               "null_sim": np.concatenate(nulls) if nulls else np.array([], np.float32), "error": errors}
    record = {"failure": failure, "shuffled": accumulator.state() if accumulator else None,
              "not_unit_left": not_unit[0], "not_unit_right": not_unit[1], "max_norm_deviation": deviation}
    return columns, record


class EmbeddingsProducer(Producer):
    """Similarities of precomputed embedding pairs: no model, no GPU."""

    def __init__(self, spec: EmbeddingSpec, cfg: EmbeddingScoreConfig):
        self.spec, self.cfg = spec, cfg
        # random-inputs needs embeddings of random inputs from the same model: there is no model to draw them
        self.beta_modes = BETA_MODES if cfg.random_embeddings is not None else ("fixed", "shuffled")

    def missing_beta(self) -> ConfigError:
        return ConfigError("scoring from embeddings has no model to draw random inputs with: pass "
                           "`random_embeddings` PATH (embeddings of random inputs from the same model), "
                           "or `beta_mode` fixed `beta` VALUE, or `beta_mode` shuffled (a diagnostic)",
                           "random_embeddings", "beta_mode", "beta")

    def units(self) -> list[str]:
        return self.spec.units(self.cfg.unit_rows)

    def settings(self) -> dict:
        spec, rand = self.spec, self.cfg.random_embeddings
        return {"source": "embeddings", "layout": spec.layout, "pair": spec.pair, "left_field": spec.left_field,
                "right_field": spec.right_field, "key_field": spec.key_field,
                "random_embeddings": rand.inputs() if rand else None}

    def input_files(self) -> list[str]:
        rand = self.cfg.random_embeddings
        return [*self.spec.sources, *self.spec.inputs(), *(rand.sources + rand.inputs() if rand else [])]

    def random_beta(self) -> tuple[BetaEstimate, str]:
        rand = self.cfg.random_embeddings
        beta = random_embeddings_beta(rand, self.cfg.batch_rows)
        return beta, f"computed from random-input embeddings supplied by the user ({', '.join(rand.sources)})"

    def score(self, work: Work, commit: Commit, task) -> dict[str, int]:
        intra_op = torch.get_num_threads()
        threads = self.cfg.threads or intra_op
        pool = ThreadPoolExecutor(threads) if threads > 1 else None
        # A unit's part is written on its own thread while the next unit is scored (pyarrow's write
        # releases the GIL); waiting for it before the next commit keeps parts in order and memory at
        # two units' columns. The `finally` waits for a commit in flight: a stopped run leaves whole parts.
        writer = ThreadPoolExecutor(1)
        pending = None
        # The pool is the parallelism; torch's own threads on block-sized conversions only contend
        # (measured: 10x more CPU per pair with 2 intra-op threads on a busy machine).
        torch.set_num_threads(1)
        try:
            for unit in (u for group in work.claimed() for u in group if u not in work.done):
                columns, record = _score_unit(unit, self.spec, self.cfg.batch_rows, pool,
                                              shuffled=self.cfg.beta_mode == "shuffled")
                if pending is not None:
                    pending.result()
                pending = writer.submit(commit, unit, columns, record)
            if pending is not None:
                pending.result()
        finally:
            writer.shutdown(wait=True)
            torch.set_num_threads(intra_op)
            if pool is not None:
                pool.shutdown()
        return {}

    def finish(self, records: dict[str, dict], counters: dict[str, int], todo: int) -> tuple[dict, dict]:
        units = list(records)
        not_unit = {side: sum(records[u].get(f"not_unit_{side}", 0) for u in units) for side in ("left", "right")}
        deviation = max((records[u].get("max_norm_deviation", 0.0) for u in units), default=0.0)
        if not_unit["left"] or not_unit["right"]:
            notice(f"{not_unit['left']:,} left and {not_unit['right']:,} right vectors were not unit length "
                   f"(largest |norm - 1| = {deviation:.3g}); they were re-normalised")
        spec = self.spec
        estimator = {"backend": "precomputed-embeddings", "layout": spec.layout, "embedding_dim": spec.dim,
                     "dtype": sorted({n.dtype for n in spec.npy}) or None}
        provenance = {"estimator": estimator, "pair": spec.pair, "input_shards": spec.inputs(), "dataset": None,
                      "renormalised": {**not_unit, "max_norm_deviation": deviation}}
        return provenance, {"not_unit_left": not_unit["left"], "not_unit_right": not_unit["right"]}


def score_embeddings(spec: EmbeddingSpec, out: str | Path | Output, config: EmbeddingScoreConfig | None = None) -> ScoreResult:
    """Score every row pair of precomputed embeddings into `out`, resumably, like `score()`."""
    cfg = config or EmbeddingScoreConfig()
    return run_scoring(EmbeddingsProducer(spec, cfg), out, cfg)


def write_embeddings(directory: str | Path, chunks: Iterable[tuple[np.ndarray, np.ndarray, list[str] | None]],
                     overwrite: bool = False) -> Path:
    """Write row-aligned (left, right, keys) chunks in clip-retrieval's layout, one numbered file
    per chunk (benchmarks and tests use it; so can users handing their own arrays to
    `pairclean score --from-embeddings`). Chunks are written as they come: memory is one chunk."""
    from pairclean.ops.atomic import atomic_path

    target = open_output(directory, (), "out", kind="directory", overwrite=overwrite)
    directory = target.path
    with target.stage() as tmp:
        for sub in _CLIP_RETRIEVAL:
            (tmp / sub).mkdir()
        for number, (left, right, keys) in enumerate(chunks):
            if left.shape != right.shape or left.ndim != 2:
                raise UserError(f"left {left.shape} and right {right.shape} must be the same 2-D shape")
            for sub, array in (("img_emb", left), ("text_emb", right)):
                with atomic_path(tmp / sub / f"{_CLIP_RETRIEVAL[sub]}{number}.npy") as path:
                    with open(path, "wb") as fh:
                        np.save(fh, array)
            if keys is not None:
                with atomic_path(tmp / "metadata" / f"metadata_{number}.parquet") as path:
                    pq.write_table(pa.table({"key": pa.array(keys, pa.string())}), path)
    return directory
