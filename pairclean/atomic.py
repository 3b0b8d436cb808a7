"""Atomic file writes: a killed process never leaves a file that looks complete but is not."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Persist a rename: the directory entry must reach the disk too."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_name(path: Path) -> Path:
    """A sibling name unique to this process, so concurrent ranks never share a temp file."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temp path to write to; on success fsync it and rename it over `path`."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        yield tmp
        if tmp.is_file():
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if tmp.exists():
            if tmp.is_dir():
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink()


def write_json(path: str | os.PathLike, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
