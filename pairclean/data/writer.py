"""Writing datasets: WebDataset shards (via wds.ShardWriter), into a directory that the caller
stages (`ops.guard.Output.stage`: a temp directory renamed into place only when complete)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import webdataset as wds



def write_shards(samples: Iterable[dict], directory: Path, prefix: str = "shard", maxcount: int = 1000,
                 maxsize: float = 1e9, encoder: bool = True) -> list[Path]:
    """Write samples ({"__key__": ..., "jpg": bytes, "txt": str, ...}) as numbered tar shards.

    `encoder=False` writes every member's bytes exactly as given (webdataset's encoder would
    gzip `*.gz` members a second time); all values must then be bytes.
    """
    directory = Path(directory)
    pattern = str(directory / f"{prefix}-%06d.tar")
    with wds.ShardWriter(pattern, maxcount=maxcount, maxsize=maxsize, verbose=0, encoder=encoder) as sink:
        for sample in samples:
            sink.write(sample)
    return sorted(directory.glob(f"{prefix}-*.tar"))
