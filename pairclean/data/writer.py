"""Writing datasets: WebDataset shards (via wds.ShardWriter), into a directory that the caller
stages (`ops.guard.Output.stage`: a temp directory renamed into place only when complete)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterable

import webdataset as wds


def shard_writer(pattern: str, **options) -> wds.ShardWriter:
    """webdataset's ShardWriter, its members stamped with a whole second. webdataset 1.0's
    TarWriter writes tarfile's default PAX format (its own `format` is not passed on), where a
    fractional mtime costs every member a PAX header block: 1 kB more a member (8% of `synth
    web-shards`' 28 kB a pair) and twice the headers for every reader to parse."""
    return wds.ShardWriter(pattern, verbose=0, mtime=int(time.time()), **options)


def write_shards(samples: Iterable[dict], directory: Path, prefix: str = "shard", maxcount: int = 1000,
                 maxsize: float = 1e9, encoder: bool = True, pattern: str | None = None,
                 post: Callable[[Path], None] | None = None) -> list[Path]:
    """Write samples ({"__key__": ..., "jpg": bytes, "txt": str, ...}) as numbered tar shards named
    PREFIX-000000.tar (or by the printf `pattern`, e.g. `%05d.tar`); `post(path)` runs as each
    shard is closed. Returns the shards written, in order.

    `encoder=False` writes every member's bytes exactly as given (webdataset's encoder would
    gzip `*.gz` members a second time); all values must then be bytes.
    """
    directory = Path(directory)
    written: list[Path] = []

    def closed(name: str) -> None:
        written.append(Path(name))
        if post is not None:
            post(Path(name))

    with shard_writer(str(directory / (pattern or f"{prefix}-%06d.tar")), maxcount=maxcount, maxsize=maxsize,
                      encoder=encoder, post=closed) as sink:
        for sample in samples:
            sink.write(sample)
    return written
