"""clip-retrieval's layout as pairclean writes it: `score --save-embeddings` (block by block, with
the pairs' `shard` and `index` in the metadata and DIR/provenance.json at the end) and
`write_embeddings` (arrays a user or a benchmark hands over). The one writer of the layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pairclean.errors import UserError
from pairclean.ops.atomic import atomic_path

CLIP_RETRIEVAL = {"img_emb": "img_emb_", "text_emb": "text_emb_", "metadata": "metadata_"}  # folder -> file prefix
SAVED_PROVENANCE = "provenance.json"  # beside img_emb/ when `score --save-embeddings` wrote the directory


def read_saved_provenance(directory: str | Path) -> dict | None:
    """What `score --save-embeddings` recorded beside the embeddings (None: another tool wrote them)."""
    path = Path(directory) / SAVED_PROVENANCE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {str(exc).splitlines()[0][:200]}") from None


def write_embedding_block(directory: str | Path, number: int, left: np.ndarray, right: np.ndarray,
                          metadata: pa.Table | None = None, temp_dir: str | Path | None = None) -> int:
    """Write block `number` of clip-retrieval's layout under `directory` (img_emb/img_emb_N.npy,
    text_emb/text_emb_N.npy, metadata/metadata_N.parquet): row-aligned left / right vectors and
    their metadata (key, and `shard`, `index` where the pairs' dataset is known). Each file is
    written under a temp name and renamed into place, so a block is rewritten whole or not at all;
    the bytes written. The one writer of the layout (`write_embeddings`, `score --save-embeddings`)."""
    directory = Path(directory)
    if left.shape != right.shape or left.ndim != 2:
        raise UserError(f"left {left.shape} and right {right.shape} must be the same 2-D shape")
    if metadata is not None and metadata.num_rows != len(left):
        raise UserError(f"metadata holds {metadata.num_rows} rows for {len(left)} embeddings")
    written = 0
    for sub, array in (("img_emb", left), ("text_emb", right)):
        (directory / sub).mkdir(parents=True, exist_ok=True)
        with atomic_path(directory / sub / f"{CLIP_RETRIEVAL[sub]}{number}.npy", temp_dir=temp_dir) as path:
            with open(path, "wb") as fh:
                np.save(fh, array)
            written += path.stat().st_size
    if metadata is not None:
        (directory / "metadata").mkdir(parents=True, exist_ok=True)
        with atomic_path(directory / "metadata" / f"{CLIP_RETRIEVAL['metadata']}{number}.parquet",
                         temp_dir=temp_dir) as path:
            pq.write_table(metadata, path)
            written += path.stat().st_size
    return written


def write_embeddings(directory: str | Path, chunks: Iterable[tuple[np.ndarray, np.ndarray, list[str] | None]],
                     overwrite: bool = False) -> Path:
    """Write row-aligned (left, right, keys) chunks in clip-retrieval's layout, one numbered block
    per chunk (benchmarks and tests use it; so can users handing their own arrays to
    `pairclean score --from-embeddings`). Chunks are written as they come: memory is one chunk."""
    from pairclean.ops.guard import open_output

    target = open_output(directory, (), "out", kind="directory", overwrite=overwrite)
    with target.stage() as tmp:
        for sub in CLIP_RETRIEVAL:
            (tmp / sub).mkdir()
        for number, (left, right, keys) in enumerate(chunks):
            write_embedding_block(tmp, number, left, right,
                                  pa.table({"key": pa.array(keys, pa.string())}) if keys is not None else None)
    return target.path
