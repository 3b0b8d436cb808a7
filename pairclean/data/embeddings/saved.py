"""clip-retrieval's layout as pairclean writes it: `score --save-embeddings` (block by block, with
the pairs' `shard` and `index` in the metadata and DIR/provenance.json at the end) and
`write_embeddings` (arrays a user or a benchmark hands over). The one writer of the layout."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pairclean.config import COSINE, COSINE_STD, COUNT, setting
from pairclean.data.record import DatasetRecord
from pairclean.data.spec import PAIR_KINDS
from pairclean.errors import UserError
from pairclean.ops.atomic import atomic_path
from pairclean.ops.places import UNFINISHED, RemotePath  # beside img_emb/ while a `score --save-embeddings` run writes the directory
from pairclean.ops.records import Json, Record

CLIP_RETRIEVAL = {"img_emb": "img_emb_", "text_emb": "text_emb_", "metadata": "metadata_"}  # folder -> file prefix
SAVED_PROVENANCE = "provenance.json"  # beside img_emb/ when `score --save-embeddings` wrote the directory


@dataclass(frozen=True)
class SavedBeta(Record):
    """The beta of the run that saved the embeddings (`core.beta.BetaEstimate`'s fields)."""

    what = "saved beta"
    mode: str
    beta: float = setting(bounds=COSINE)
    std: float | None = setting(None, COSINE_STD)
    k: int | None = setting(None, COUNT)
    seed: int | None = None


@dataclass(frozen=True)
class SavedBlock(Record):
    what = "saved block"
    unit: str  # the unit whose rows block N holds
    rows: int


@dataclass(frozen=True)
class SavedEmbeddings(Record):
    """DIR/provenance.json: what `score --save-embeddings` recorded beside the embeddings, written
    when every unit is committed (its presence marks the directory complete, `blocks` what it holds)."""

    what = "saved-embeddings provenance"
    written_by: str
    pair: str
    rows: int
    blocks: dict[str, SavedBlock]
    beta: SavedBeta
    estimator: dict[str, Json] | None = None  # the backend's own provenance
    pairclean_version: str | None = None
    weights_sha1: str | None = None
    preprocessing: str | None = None
    img_emb: str | None = None  # the modality of each side
    text_emb: str | None = None
    dtype: str | None = None
    normalised: bool | None = None
    bytes: int | None = None
    dataset: DatasetRecord | None = None  # the dataset scored, with its files' fingerprints
    input_shards: list[str] | None = None

    def problems(self):
        if self.pair not in PAIR_KINDS:
            yield "pair", f"must be one of {', '.join(PAIR_KINDS)}, got {self.pair!r}"
        for name in ("rows", "bytes"):
            if (getattr(self, name) or 0) < 0:
                yield name, f"must be 0 or more, got {getattr(self, name)}"
        for number, block in self.blocks.items():
            if not number.isdigit() or block.rows < 0:
                yield f"blocks.{number}", "must be a block number holding 0 rows or more"

    def check_blocks(self, root: Path, held: dict[int, int]) -> None:
        """The directory holds the blocks this record lists, each with its rows, and no other."""
        listed = {int(n): block.rows for n, block in self.blocks.items()}
        where = root / SAVED_PROVENANCE
        for number in sorted(listed.keys() | held.keys()):
            if number not in held:
                raise UserError(f"{where} lists block {number} ({listed[number]:,} rows) but {root} does not hold it: "
                                "the directory is not whole; save the embeddings again")
            if number not in listed:
                raise UserError(f"{root} holds block {number}, which {where} does not list: blocks of another run?")
            if held[number] != listed[number]:
                raise UserError(f"block {number} of {root} holds {held[number]:,} rows, {where} says "
                                f"{listed[number]:,}")
        if sum(listed.values()) != self.rows:
            raise UserError(f"{where} says rows {self.rows:,} but its blocks hold {sum(listed.values()):,}")


def read_saved_provenance(directory: str | Path) -> SavedEmbeddings | None:
    """What `score --save-embeddings` recorded beside the embeddings (None: another tool wrote them)."""
    path = Path(directory) / SAVED_PROVENANCE
    return SavedEmbeddings.read(path) if path.is_file() else None


def write_embedding_block(directory: str | Path | RemotePath, number: int, left: np.ndarray, right: np.ndarray,
                          metadata: pa.Table | None = None, temp_dir: str | Path | None = None) -> int:
    """Write block `number` of clip-retrieval's layout under `directory` (img_emb/img_emb_N.npy,
    text_emb/text_emb_N.npy, metadata/metadata_N.parquet): row-aligned left / right vectors and
    their metadata (key, and `shard`, `index` where the pairs' dataset is known). Each file is
    written under a temp name and renamed into place, so a block is rewritten whole or not at all;
    the bytes written (on an object store each file is one object, uploaded whole). The one writer
    of the layout (`write_embeddings`, `score --save-embeddings`)."""
    directory = directory if isinstance(directory, RemotePath) else Path(directory)
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
