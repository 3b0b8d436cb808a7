"""`pairclean query`'s output: a result streamed as CSV, JSON Lines or Parquet, to a file or stdout.

The statement runs in a `scores.db.ScoresDB` (`ScoresDB.run` refuses anything but one read-only
statement); a result arrives as Arrow record batches, so writing it is bounded by a batch.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import IO, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from pairclean.config import check_choice
from pairclean.errors import ConfigError
from pairclean.ops.guard import Output, open_output

OUTPUT_FORMATS = ("table", "csv", "json", "parquet")  # "table" is the command line's rich table


def _json_value(value, float32: bool):
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        # A float32 printed through float64 shows noise digits: keep the shortest float32 form.
        return float(str(np.float32(value))) if float32 else value
    if isinstance(value, bytes):
        return value.hex()
    return value


def write_result(batches: Iterable[pa.RecordBatch], schema: pa.Schema, fmt: str, out: Output | Path | None,
                 stdout: IO[bytes] | None = None) -> int:
    """Stream a result as CSV, JSON Lines or Parquet to `out` (atomically; opened by the caller with
    the inputs it must not replace, `ops.guard.open_output`) or stdout; returns rows."""
    check_choice(fmt, OUTPUT_FORMATS[1:], "format")
    stdout = stdout if stdout is not None else sys.stdout.buffer
    if fmt == "parquet" and out is None and stdout.isatty():
        raise ConfigError("refusing to write Parquet to a terminal: set `out` to a file or redirect stdout", "out")

    def emit(sink) -> int:
        rows = 0
        if fmt == "csv":
            with pacsv.CSVWriter(sink, schema) as writer:
                for batch in batches:
                    writer.write_batch(batch)
                    rows += batch.num_rows
        elif fmt == "json":
            single = {f.name for f in schema if f.type == pa.float32()}
            for batch in batches:
                for row in batch.to_pylist():
                    line = {k: _json_value(v, k in single) for k, v in row.items()}
                    sink.write(json.dumps(line, default=str).encode() + b"\n")
                rows += batch.num_rows
        else:
            with pq.ParquetWriter(sink, schema, compression="zstd") as writer:
                for batch in batches:
                    writer.write_batch(batch)
                    rows += batch.num_rows
        return rows

    if out is None:
        rows = emit(stdout)
        stdout.flush()
        return rows
    with open_output(out).write() as tmp, open(tmp, "wb") as fh:
        return emit(fh)
