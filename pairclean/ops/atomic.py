"""Atomic file writes: a killed process never leaves a file that looks complete but is not.

Every output is written under a temp name (dot-prefixed, `.tmp-` infix, so no reader globbing
`*.parquet` or `*.json` ever picks it up), fsynced, renamed into place, and the directory
fsynced so the rename itself survives a power cut. On an object store (`ops.places.RemotePath`)
the temp is a local file uploaded as one object, which appears whole or not at all; a folder
written whole is marked unfinished (`places.UNFINISHED`) until its last object is in.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path

from pairclean.errors import ConfigError, UserError
from pairclean.ops.faults import fault_point
from pairclean.ops.places import UNFINISHED, RemotePath

TEMP_INFIX = ".tmp-"


def fsync_dir(path: Path) -> None:
    """Persist a rename: the directory entry must reach the disk too."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory; the rename is still atomic
    finally:
        os.close(fd)


def temp_name(path: Path, directory: Path | None = None) -> Path:
    """A temp name no other writer can pick: host, pid and a random token (pids repeat across the
    hosts of a shared filesystem and across restarts)."""
    host = socket.gethostname().split(".")[0] or "host"
    return (directory or path.parent) / f".{path.name}{TEMP_INFIX}{host}-{os.getpid()}-{secrets.token_hex(4)}"


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and TEMP_INFIX in name


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _place(tmp: Path, path: Path, no_clobber: bool) -> None:
    if not no_clobber:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)  # fails if `path` appeared meanwhile: never replaces someone's file
    except FileExistsError:
        raise ConfigError(f"{path} appeared while this run was writing it; pass `overwrite` to replace it",
                          "overwrite") from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        if path.exists():  # a filesystem without hard links: check, then rename
            raise ConfigError(f"{path} appeared while this run was writing it; pass `overwrite` to replace it",
                              "overwrite") from None
        os.replace(tmp, path)
        return
    tmp.unlink()


@contextmanager
def atomic_path(path: str | os.PathLike, temp_dir: str | os.PathLike | None = None, no_clobber: bool = False):
    """Yield a temp path to write to; on success fsync it and rename it over `path`.

    `temp_dir`: where the temp lives (same filesystem as `path`), e.g. a run's parts directory
    so that a killed run's leftovers go away with it. `no_clobber`: refuse to replace a file
    that appeared at `path` in the meantime.
    """
    if isinstance(path, RemotePath):
        with _uploaded(path, no_clobber) as tmp:
            yield tmp
        return
    path = Path(path)
    tmp = temp_name(path, Path(temp_dir) if temp_dir is not None else None)
    try:
        yield tmp
        if tmp.is_file():
            _fsync_file(tmp)
        fault_point("before-rename")
        _place(tmp, path, no_clobber)
        fsync_dir(path.parent)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


@contextmanager
def _uploaded(path: RemotePath, no_clobber: bool):
    """A local temp for an object: uploaded whole when the block ends without error."""
    with tempfile.TemporaryDirectory(prefix="pairclean-upload-") as folder:
        tmp = Path(folder) / f".{path.name}{TEMP_INFIX}upload"
        yield tmp
        fault_point("before-rename")
        if no_clobber and path.exists():
            raise ConfigError(f"{path} appeared while this run was writing it; pass `overwrite` to replace it",
                              "overwrite")
        path.upload(tmp)


@contextmanager
def atomic_directory(path: str | os.PathLike, overwrite: bool = False):
    """Yield a temp sibling directory to fill; on success it replaces `path` (an existing non-empty
    directory only with `overwrite`); on failure it is removed and `path` is left as it was.
    On an object store the folder holds `UNFINISHED` from before its first object is replaced
    until its last is in: readers refuse it meanwhile (a killed upload stays refused)."""
    if isinstance(path, RemotePath):
        if path.is_dir() and not overwrite:
            raise ConfigError(f"{path} exists and is not empty; pass `overwrite` to replace it", "overwrite")
        with tempfile.TemporaryDirectory(prefix="pairclean-stage-") as tmp:
            yield Path(tmp)
            marker = path / UNFINISHED
            marker.write_text('{"written_by": "pairclean"}')
            for entry in path.iterdir():
                if entry != marker:
                    entry.remove_tree()
            for file in sorted(p for p in Path(tmp).rglob("*") if p.is_file()):
                (path / file.relative_to(tmp).as_posix()).upload(file)
                fault_point("uploaded")
            marker.unlink()
        return
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())) and not overwrite:
        raise ConfigError(f"{path} exists and is not empty; pass `overwrite` to replace it", "overwrite")
    if not path.parent.exists():
        raise UserError(f"directory {path.parent} does not exist")
    tmp = temp_name(path)
    tmp.mkdir()
    try:
        yield tmp
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_temps(directory: Path) -> int:
    """Delete temp files that killed writers left in `directory`; call only while holding the
    directory's run lock (no live writer can own them then)."""
    removed = 0
    if not directory.is_dir():
        return removed
    for entry in directory.iterdir():
        if is_temp_name(entry.name):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed += 1
    return removed


def write_json(path: str | os.PathLike | RemotePath, obj, temp_dir: str | os.PathLike | None = None) -> None:
    with atomic_path(path, temp_dir=temp_dir) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
