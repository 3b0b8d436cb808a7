"""Key lists: the files a keep-list or an exported subset comes in.

  .npy      DataComp's subset format (README "Selecting samples", resharder.py `load_subset`): a
            structured array of dtype ("u8", "u8"), the high and low 64 bits of each 128-bit uid,
            sorted; a file without the .npy magic is read as a raw array of that dtype, as the
            resharder does. A plain 1-D array (strings or integers) is read as keys too.
  .parquet  a column `key` (else `uid`, else the only column)
  other     text, one key per line: lines are split at "\\n" only (a key may hold any other
            character, spaces at either end included); a trailing "\\r" (a file saved on Windows)
            and a leading byte-order mark are dropped, empty lines skipped

Keys are strings everywhere in pairclean: a uid is its 32 lower-case hex digits. What `write_keys`
writes, `read_keys` reads back as the same set: a key the format cannot hold is refused before
anything is written (a line break or an empty key in text; anything but a uid in .npy).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pairclean.errors import UserError

UID_DTYPE = np.dtype("u8,u8")
KEY_COLUMNS = ("key", "uid")
# DataComp's uids are md5 digests in lower-case hex; their tools split one into halves with
# (int(uid[:16], 16), int(uid[16:32], 16)) (baselines/utils.py; resharder.py: divmod(int(uid, 16), 2**64)).
# `int` also takes upper case, "0x", "+", "_" and spaces, so only this form round-trips.
UID = re.compile(r"[0-9a-f]{32}")
BOM = "\ufeff"


def uid_strings(pairs: np.ndarray) -> list[str]:
    """(high, low) 64-bit halves -> 32-hex-digit uids."""
    return [f"{int(hi):016x}{int(lo):016x}" for hi, lo in zip(pairs["f0"], pairs["f1"])]


def uid_pairs(keys: Iterable[str]) -> np.ndarray:
    """32-hex-digit uids -> DataComp's sorted (high, low) array; a key that is not one is refused."""
    halves = []
    for key in keys:
        if not isinstance(key, str) or not UID.fullmatch(key):
            raise UserError(f"key {key!r} is not a DataComp uid (32 lower-case hex digits): a .npy subset holds "
                            "uids only; export other keys as .txt or .parquet")
        halves.append((int(key[:16], 16), int(key[16:], 16)))
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


def _read_text(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    lines = (text[len(BOM):] if text.startswith(BOM) else text).split("\n")
    return [line for line in (ln[:-1] if ln.endswith("\r") else ln for ln in lines) if line]


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
            keys = _read_text(path)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read key list {path}: {str(exc).splitlines()[0][:200]}") from None
    return pa.array(keys, pa.string())


def _text_lines(keys: list[str]) -> str:
    for key in keys:
        if not key or "\n" in key or "\r" in key or key.startswith(BOM):
            raise UserError(f"key {key!r} cannot be written to a text key list (one key per line: no line break, "
                            "no empty key, no leading byte-order mark); export the keys as .parquet")
    return "".join(f"{k}\n" for k in keys)


def write_keys(path: str | Path, keys: Iterable[str], suffix: str | None = None) -> int:
    """Write keys to `path` in the format `suffix` (by default the path's own) names (.npy:
    DataComp's sorted uid array; .parquet; else text); how many. Every key is checked before
    anything is written; a caller that needs the file whole writes to a temp path
    (`ops.guard.Output.write`)."""
    path = Path(path)
    suffix = suffix if suffix is not None else path.suffix
    keys = list(keys)
    if suffix == ".npy":
        uids = uid_pairs(keys)
        with open(path, "wb") as fh:
            np.save(fh, uids)
    elif suffix == ".parquet":
        pq.write_table(pa.table({"key": pa.array(keys, pa.string())}), path)
    else:
        path.write_text(_text_lines(keys), encoding="utf-8", newline="")
    return len(keys)
