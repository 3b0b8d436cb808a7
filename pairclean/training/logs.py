"""Training records: metrics as JSONL, per-pair diagnostics as Parquet.

metrics.jsonl gets one complete line per write (flushed), so a killed run leaves at most one torn
last line; `MetricsLog.resume` rewrites the file atomically keeping only the lines of the epochs
the resumed state contains. Diagnostics stream to `diagnostics/epoch-NNN.parquet` in row groups
(memory bounded by `flush_rows`) and are renamed into place when the epoch ends.
"""

from __future__ import annotations

import json
import math
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pairclean.ops.atomic import atomic_path


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    return value


class MetricsLog:
    def __init__(self, path: Path):
        self.path = Path(path)

    def resume(self, last_epoch: int) -> None:
        """Keep the records of epochs <= last_epoch (the ones the saved state includes)."""
        kept = []
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line torn by a kill
                if record.get("epoch", 0) <= last_epoch:
                    kept.append(line)
        with atomic_path(self.path) as tmp:
            tmp.write_text("".join(f"{line}\n" for line in kept))

    def reset(self) -> None:
        with atomic_path(self.path) as tmp:
            tmp.write_text("")

    def write(self, record: dict) -> None:
        line = json.dumps({k: _clean(v) for k, v in record.items()}, sort_keys=False)
        with open(self.path, "a") as fh:
            fh.write(line + "\n")
            fh.flush()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class DiagnosticsWriter:
    """Per-pair columns of one epoch (key, shard, index + whatever the method reports)."""

    def __init__(self, path: Path, flush_rows: int = 65536):
        self.path = Path(path)
        self.stack = ExitStack()
        self.tmp = self.stack.enter_context(atomic_path(self.path))  # renamed into place by close()
        self.flush_rows = flush_rows
        self.columns: dict[str, list] = {}
        self.rows = 0
        self.writer: pq.ParquetWriter | None = None

    def add(self, columns: dict[str, list | np.ndarray]) -> None:
        for name, values in columns.items():
            self.columns.setdefault(name, []).extend(values.tolist() if isinstance(values, np.ndarray) else values)
        self.rows = len(next(iter(self.columns.values())))
        if self.rows >= self.flush_rows:
            self._flush()

    def _flush(self) -> None:
        if not self.rows:
            return
        table = pa.table(self.columns)
        if self.writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.writer = pq.ParquetWriter(self.tmp, table.schema, compression="zstd")
        self.writer.write_table(table.cast(self.writer.schema))
        self.columns, self.rows = {}, 0

    def close(self) -> Path | None:
        """Write what is left and rename the file into place; None when the epoch had no rows."""
        self._flush()
        if self.writer is None:
            self.stack.pop_all()  # nothing was written: no file, nothing to rename
            return None
        self.writer.close()
        self.stack.close()
        return self.path

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.stack.pop_all()
        self.tmp.unlink(missing_ok=True)
