"""Key lists: the files a keep-list or an exported subset comes in.

  .npy      DataComp's subset format (README "Selecting samples", resharder.py `load_subset`): a
            structured array of dtype ("u8", "u8"), the high and low 64 bits of each 128-bit uid,
            sorted; a file without the .npy magic is read as a raw array of that dtype, as the
            resharder does. A plain 1-D array (strings or integers) is read as keys too.
  .parquet  a column `key` (else `uid`, else the only column)
  other     text, one key per line (blank lines skipped)

Keys are strings everywhere in pairclean: a uid is its 32 lower-case hex digits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pairclean.errors import UserError

UID_DTYPE = np.dtype("u8,u8")
KEY_COLUMNS = ("key", "uid")


def uid_strings(pairs: np.ndarray) -> list[str]:
    """(high, low) 64-bit halves -> 32-hex-digit uids."""
    return [f"{int(hi):016x}{int(lo):016x}" for hi, lo in zip(pairs["f0"], pairs["f1"])]


def uid_pairs(keys: Iterable[str]) -> np.ndarray:
    """32-hex-digit uids -> DataComp's sorted (high, low) array; a key that is not one is refused."""
    halves = []
    for key in keys:
        try:
            value = int(key, 16)
            if len(key) != 32 or value < 0:
                raise ValueError
        except (TypeError, ValueError):
            raise UserError(f"key {key!r} is not a DataComp uid (32 hex digits): a .npy subset holds uids only; "
                            "export other keys as .txt or .parquet") from None
        halves.append(divmod(value, 1 << 64))
    array = np.array(halves, dtype=UID_DTYPE) if halves else np.empty(0, dtype=UID_DTYPE)
    array.sort()
    return array


def _read_npy(path: Path) -> list[str]:
    with open(path, "rb") as fh:
        magic = fh.read(6)
    if magic != b"\x93NUMPY":  # the resharder reads such a file as a raw array of uid halves
        return uid_strings(np.fromfile(path, dtype=UID_DTYPE))
    array = np.load(path, allow_pickle=False)
    if array.dtype == UID_DTYPE:
        return uid_strings(array)
    if array.ndim != 1:
        raise UserError(f"{path} holds an array of shape {array.shape}; a key list is 1-D (or DataComp's u8,u8 uids)")
    return [str(k) for k in array.tolist()]


def _read_parquet(path: Path) -> list[str]:
    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    column = next((c for c in KEY_COLUMNS if c in names), names[0] if len(names) == 1 else None)
    if column is None:
        raise UserError(f"{path} has no key column ({' or '.join(KEY_COLUMNS)}) and more than one column: {names}")
    return [str(k) for k in pf.read(columns=[column]).column(0).to_pylist() if k is not None]


def read_keys(path: str | Path) -> pa.Array:
    """The keys a file lists, as strings (see the module's formats)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"key list not found: {path}")
    try:
        if path.suffix == ".npy":
            keys = _read_npy(path)
        elif path.suffix == ".parquet":
            keys = _read_parquet(path)
        else:
            keys = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read key list {path}: {str(exc).splitlines()[0][:200]}") from None
    return pa.array(keys, pa.string())


def write_keys(path: str | Path, keys: Iterable[str]) -> int:
    """Write keys in the format the suffix names (.npy: DataComp's sorted uid array); returns how many."""
    from pairclean.ops.atomic import atomic_path

    path = Path(path)
    keys = list(keys)
    with atomic_path(path) as tmp:
        if path.suffix == ".npy":
            with open(tmp, "wb") as fh:
                np.save(fh, uid_pairs(keys))
        elif path.suffix == ".parquet":
            pq.write_table(pa.table({"key": pa.array(keys, pa.string())}), tmp)
        else:
            tmp.write_text("".join(f"{k}\n" for k in keys), encoding="utf-8")
    return len(keys)
