"""Arrays of embeddings stored as .npy data (an .npy file, or a member of an uncompressed .npz),
read in place: the header is parsed once, rows are read with pread at their offset."""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq

from pairclean.errors import ConfigError, UserError

NPY_DTYPES = (np.float16, np.float32, np.float64)
ORIGIN_COLUMNS = ("shard", "index")  # metadata columns naming each row's pair in its dataset (`score --save-embeddings`)


@dataclass(frozen=True)
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


def npz_member(path: str, name: str) -> tuple[tuple[int, ...], np.dtype, int]:
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


def npy_pair(left: Array, right: Array, keys: str | None, key_field: str | None,
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
        except Exception as exc:  # pyarrow raises several types for a file that is not Parquet
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


def npy_file(path: str) -> Array:
    """An .npy file as one side of a pair."""
    return (path, path, *_npy_header(path))


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
