"""Copying img2dataset output as img2dataset writes it: filter writes, beside each tar it writes, the
kept samples' sidecar rows and a stats summary, so the output has the input's shape (DataComp's
resharder, which sizes shards from `_stats.json`, takes it as input); corrupt copies the sidecar
with the changed captions and the stats as they were."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pairclean.data.formats.img2dataset import (SUCCESS, Img2DatasetParquet, Img2DatasetWebDataset, columns_of,
                                                read_table)
from pairclean.data.reading.inputs import parquet_file
from pairclean.data.reading.tar import Sample, sample_key
from pairclean.data.rewriting.base import KeptRows, NextCaption, Progress, Written, rewrites
from pairclean.data.rewriting.parquet import ParquetRewriter
from pairclean.data.rewriting.tar import TarRewriter
from pairclean.ops.atomic import write_json


def stats_path(data_file: Path) -> Path:
    """`00000.tar` / `00000.parquet` -> `00000_stats.json`."""
    return data_file.with_name(data_file.name.split(".")[0] + "_stats.json")


def write_stats(data_file: Path, table: pa.Table | None, count: int) -> None:
    """img2dataset's per-shard stats for a shard pairclean wrote (DataComp's resharder reads `successes`)."""
    statuses = table.column("status").to_pylist() if table is not None and "status" in table.column_names \
        else [SUCCESS] * count
    by_status: dict[str, int] = {}
    for status in statuses:
        by_status[str(status)] = by_status.get(str(status), 0) + 1
    write_json(stats_path(data_file), {"count": len(statuses), "successes": by_status.get(SUCCESS, 0),
                                       "failed_to_download": by_status.get("failed_to_download", 0),
                                       "failed_to_resize": by_status.get("failed_to_resize", 0),
                                       "status_dict": by_status, "written_by": "pairclean"})


@rewrites(Img2DatasetWebDataset)
class Img2DatasetTarRewriter(TarRewriter):
    """Tars with their sidecars (img2dataset webdataset output, DataComp's shards)."""

    format: Img2DatasetWebDataset

    def write_kept(self, kept: KeptRows, tmp: Path, prefix: str, shard_size: int, shard_bytes: float,
                   progress: Progress) -> Written:
        # The sidecar row of each sample handed to the writer, in order (None: the sidecar has no row
        # for it); a closed shard takes as many as it holds: the writer closes a shard when the next
        # sample arrives, so the last one handed over may belong to the next shard.
        self._rows: list[pa.Table | None] = []
        self._index: tuple[str | None, dict[str, int], pa.Table | None] = (None, {}, None)
        return super().write_kept(kept, tmp, prefix, shard_size, shard_bytes, progress)

    def on_kept(self, shard: str, sample: Sample) -> None:
        if self._index[0] != shard:
            sidecar = self.format.sidecar(shard)
            table = read_table(sidecar) if sidecar is not None else None
            column = self.format.sidecar_key()
            rows = {str(k): i for i, k in enumerate(table.column(column).to_pylist())} \
                if table is not None and column in table.column_names else {}
            self._index = (shard, rows, table)
        _, rows, table = self._index
        row = rows.get(sample_key(self.spec.fields.key, sample))
        self._rows.append(table.slice(row, 1) if row is not None else None)

    def on_closed(self, path: Path) -> None:
        count = self.format.count(str(path))
        mine, self._rows = [t for t in self._rows[:count] if t is not None], self._rows[count:]
        table = pa.concat_tables(mine, promote_options="default") if mine else None
        if table is not None:
            pq.write_table(table, path.with_suffix(".parquet"))
        write_stats(path, table, count)

    # -- corrupt: the sidecar copied with the changed captions -------------------------------

    def rewrite(self, shard: str, tmp: Path, next_caption: NextCaption, caption_field: str) -> None:
        changed: dict[str, str] = {}

        def recording(path: str, index: int, key: str | None) -> str | None:
            new = next_caption(path, index, key)
            if new is not None:
                changed[str(key)] = new
            return new

        super().rewrite(shard, tmp, recording, caption_field)
        sidecar = self.format.sidecar(shard)
        target = tmp / self.output_name(shard)
        if sidecar is None:
            return
        table = read_table(sidecar)
        column = self.format.sidecar_key()
        if changed and "caption" in table.column_names and column in table.column_names:
            keys = [str(k) for k in table.column(column).to_pylist()]
            captions = [changed.get(k, c) for k, c in zip(keys, table.column("caption").to_pylist())]
            index = table.schema.get_field_index("caption")
            table = table.set_column(index, table.schema.field(index), pa.array(captions, pa.string()))
        pq.write_table(table, target.with_suffix(".parquet"))
        stats = stats_path(Path(shard))
        if stats.is_file():
            stats_path(target).write_bytes(stats.read_bytes())


@rewrites(Img2DatasetParquet)
class Img2DatasetParquetRewriter(ParquetRewriter):
    """img2dataset Parquet output, with a stats summary beside each file."""

    def on_written(self, target: Path, rows: int) -> None:
        write_stats(target, parquet_file(str(target)).read(columns=["status"])
                    if "status" in columns_of(str(target)) else None, rows)

    def rewrite(self, shard: str, tmp: Path, next_caption: NextCaption, caption_field: str) -> None:
        super().rewrite(shard, tmp, next_caption, caption_field)
        stats = stats_path(Path(shard))
        if stats.is_file():
            stats_path(tmp / self.output_name(shard)).write_bytes(stats.read_bytes())
