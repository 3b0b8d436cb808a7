"""Where a dataset path points: this machine, or elsewhere (a URL with a scheme, a `pipe:` command).

Every stage asks: the reader (how to open it; a local one only when it is a regular file), the
output guard (only local files can overlap an output), resume fingerprints and training's shard
checks (only local files can be stat'ed).
"""

from __future__ import annotations

import os
import stat


def is_local(url: str) -> bool:
    """A path on this machine that plain `open()` reads, as opposed to a `pipe:` command or a URL
    with a scheme (read through fsspec)."""
    return "://" not in url and not url.startswith("pipe:")


def local_path(url: str) -> str | None:
    """The file on this machine that a spelling names, however it is spelled: a plain path, or a URL
    that fsspec reads from the local filesystem (`file://D/x.parquet`, `local://...`, and chained
    ones such as `simplecache::file://...`); None for a remote URL or a `pipe:` command. The output
    guard compares these, so that `file://D/d.parquet` and `D/d.parquet` are one file."""
    url = str(url)
    if url.startswith("pipe:"):
        return None
    from fsspec.implementations.local import LocalFileSystem

    if url.startswith(("file:/", "local:/")):  # also `file:/x`, the form a URL takes once parsed as a path
        return LocalFileSystem._strip_protocol(url)
    if is_local(url):
        return url
    import fsspec.core

    target = url.rsplit("::", 1)[-1]  # a chain opens its last URL
    protocol, _ = fsspec.core.split_protocol(target)
    if protocol is None:
        return target
    if protocol in LocalFileSystem.protocol:
        return LocalFileSystem._strip_protocol(target)
    return None


def file_kind(mode: int) -> str:
    """What a file that is not a regular file is, in words (from its `st_mode`)."""
    return next((name for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"),
                                         (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                                         (stat.S_ISBLK, "a block device")) if test(mode)), "not a regular file")


def not_regular(path: str) -> str | None:
    """What a local path is when it is not a regular file (None: it is one, or it does not exist).
    Only regular files are opened: opening a named pipe blocks until something writes to it."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else file_kind(mode)
