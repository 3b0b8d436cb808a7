"""Copying Parquet files: filter writes one file per input file that keeps rows (row groups
re-packed to the input's size, the schema and its metadata kept); corrupt copies each file under
its own name with the caption column changed."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pairclean.data.formats.hf import HfParquet
from pairclean.data.formats.parquet import ParquetFormat
from pairclean.data.rewriting.base import KeptRows, NextCaption, Progress, Rewriter, Written, changed, check_key, rewrites
from pairclean.errors import UserError


class _RowGroupBuffer:
    """Re-pack filtered rows into row groups of the input's size (heavy filtering would
    otherwise leave many tiny row groups)."""

    def __init__(self, writer: pq.ParquetWriter, rows: int):
        self.writer, self.rows, self.parts, self.count = writer, max(rows, 1), [], 0

    def add(self, table: pa.Table) -> None:
        self.parts.append(table)
        self.count += table.num_rows
        if self.count >= self.rows:
            whole = pa.concat_tables(self.parts)
            full = self.count // self.rows * self.rows
            self.writer.write_table(whole.slice(0, full), row_group_size=self.rows)
            rest = whole.slice(full)
            self.parts, self.count = ([rest] if rest.num_rows else []), rest.num_rows

    def flush(self) -> None:
        """Write the last, partial row group."""
        if self.count:
            self.writer.write_table(pa.concat_tables(self.parts), row_group_size=self.rows)
        self.parts, self.count = [], 0


@rewrites(ParquetFormat)
class ParquetRewriter(Rewriter):
    format: ParquetFormat

    def check_rewritable(self) -> None:
        if self.spec.fields.image_path or self.spec.fields.image2_path:
            raise UserError("this Parquet dataset names images by relative path: a copy in another directory "
                            "could not find them; use a Parquet that holds the image bytes")

    def bytes_estimated(self) -> bool:
        return True

    def target_name(self, prefix: str, number: int, shard: str) -> str:
        """A filtered file's name: PREFIX-000000.parquet, or with an empty prefix the input's own name."""
        return f"{prefix}-{number:06d}.parquet" if prefix else os.path.basename(shard)

    def on_written(self, target: Path, rows: int) -> None:
        """A filtered file was written (a layout with per-file metadata writes it beside)."""

    def write_kept(self, kept: KeptRows, tmp: Path, prefix: str, shard_size: int, shard_bytes: float,
                   progress: Progress) -> Written:
        written = Written()
        shards = list(dict.fromkeys(self.spec.shards))
        names = [self.target_name(prefix, 0, s) for s in shards]
        if not prefix and len(set(names)) != len(names):
            raise UserError("two input files share a name: give a `prefix` to number the output files instead")
        for shard in shards:
            target = tmp / self.target_name(prefix, len(written.files), shard)
            rows = self._filter_file(kept, shard, target, written)
            if rows:
                written.files.append(target)
                self.on_written(target, rows)
            if progress:
                progress(shard)
        return written

    def _filter_file(self, kept: KeptRows, path: str, target: Path, written: Written) -> int:
        """Write the kept rows of one Parquet file to `target`: how many (0: no file written)."""
        pf = pq.ParquetFile(path)
        meta = pf.metadata
        max_rows = max((meta.row_group(g).num_rows for g in range(meta.num_row_groups)), default=0)
        last_scored = kept.last_index(path)
        if last_scored is not None and last_scored >= meta.num_rows:
            raise changed(path, f"it has {meta.num_rows} rows, the scores have index {last_scored}")
        writer = buffer = None
        offset = rows = 0
        key_column = self.spec.fields.key
        try:
            for g in range(meta.num_row_groups):
                n = meta.row_group(g).num_rows
                dec = kept.decisions(path, offset, offset + n - 1)
                if dec.keep.any():
                    table = pf.read_row_group(g)
                    if key_column in table.column_names:  # rows keyed by position have nothing stored to compare
                        for i, value in enumerate(table.column(key_column).to_pylist()):
                            check_key(path, dec, i, str(value))
                    table = table.filter(pa.array(dec.keep))
                    rows += table.num_rows
                    if writer is None:
                        writer = pq.ParquetWriter(target, pf.schema_arrow, compression="zstd")
                        buffer = _RowGroupBuffer(writer, max_rows)
                    buffer.add(table)
                offset += n
            if buffer is not None:
                buffer.flush()
        finally:
            if writer is not None:
                writer.close()
        if writer is not None:
            written.pairs += rows
            written.bytes += target.stat().st_size
        return rows

    def kept_bytes(self, kept: KeptRows, shard: str, failures: list[dict]) -> tuple[int, np.ndarray]:
        """Dry run: each row group's compressed size shared out over its rows (an estimate)."""
        meta = pq.ParquetFile(shard).metadata
        total, per_rule, offset = 0, np.zeros(kept.rules + 1, np.int64), 0
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            dec = kept.decisions(shard, offset, offset + n - 1)
            rg = meta.row_group(g)
            size = sum(rg.column(c).total_compressed_size for c in range(rg.num_columns)) / max(n, 1)
            total += round(size * int(dec.scored.sum()))
            per_rule += np.round(size * dec.flags.sum(axis=1)).astype(np.int64)
            offset += n
        return total, per_rule

    # -- corrupt -----------------------------------------------------------------------------

    def rewrite(self, shard: str, tmp: Path, next_caption: NextCaption, caption_field: str) -> None:
        pf = pq.ParquetFile(shard)
        schema = pf.schema_arrow
        if caption_field not in schema.names:
            raise UserError(f"{shard} has no caption column {caption_field!r} (has {', '.join(schema.names)})")
        column = schema.get_field_index(caption_field)
        meta = pf.metadata
        codec = meta.row_group(0).column(0).compression if meta.num_row_groups and meta.num_columns else "ZSTD"
        with pq.ParquetWriter(tmp / self.output_name(shard), schema,
                              compression="none" if codec == "UNCOMPRESSED" else codec.lower()) as writer:
            offset = 0
            for rg in range(meta.num_row_groups):
                table = pf.read_row_group(rg)
                values = table.column(column).to_pylist()
                changed_any = False
                for i in range(table.num_rows):
                    new = next_caption(shard, offset + i, None)
                    if new is not None:
                        values[i] = new
                        changed_any = True
                if changed_any:
                    table = table.set_column(column, schema.field(column),
                                             pa.array(values, type=schema.field(column).type))
                writer.write_table(table, row_group_size=max(table.num_rows, 1))
                offset += table.num_rows


@rewrites(HfParquet)
class HfParquetRewriter(ParquetRewriter):
    format: HfParquet

    def copy_root(self) -> str | None:
        """A copy elsewhere reads path-only images from this dataset's root (recorded in its manifest)."""
        return str(self.format.image_root(self.spec.shards[0]).resolve())
