"""Where a dataset path points: this machine, or elsewhere (a URL with a scheme, a `pipe:` command).

Every stage asks: the reader (how to open it), the output guard (only local files can overlap an
output), resume fingerprints and training's shard checks (only local files can be stat'ed).
"""

from __future__ import annotations


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
