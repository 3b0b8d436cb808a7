"""Encoding batches of any shape (a tensor, a list, a dict of tensors) in chunks that fit in memory.

On a device with less memory than the batch size needs, the run goes on in smaller chunks
instead of ending; a CPU-only machine never meets this.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from pairclean.backends.base import host_values
from pairclean.backends.inputs import TokenBatch
from pairclean.ops.notices import notice_once


def batch_rows(batch: Any) -> int:
    """Rows of a collated batch: a tensor, a list/tuple of rows, or a dict of such."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, dict):
        return batch_rows(next(iter(batch.values())))
    return len(batch)


def take_rows(batch: Any, rows: slice | list[int]) -> Any:
    """The same kind of batch holding only `rows` (a slice, or a list of positions)."""
    if isinstance(batch, torch.Tensor):
        return batch[rows] if isinstance(rows, slice) else batch[host_values(rows, batch.device)]
    if isinstance(batch, dict):
        return {k: take_rows(v, rows) for k, v in batch.items()}
    if isinstance(batch, TokenBatch):
        return batch.take(rows)
    if isinstance(rows, slice):
        return batch[rows]
    return type(batch)(batch[i] for i in rows)


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


class OomBackoff:
    """Encode a batch in chunks; on out-of-memory halve the chunk size and retry that chunk.

    The smaller size is kept for the rest of the run (the memory that ran out will run out
    again), and the first halving is reported once.
    """

    def __init__(self, chunk: int | None = None):
        self.chunk = chunk  # None: whole batches until the first out-of-memory
        self.halvings = 0

    def __call__(self, fn: Callable[[Any], torch.Tensor], batch: Any) -> torch.Tensor:
        n = batch_rows(batch)
        out, start = [], 0
        while start < n:
            size = min(self.chunk or n, n - start)
            part = batch if (start == 0 and size == n) else take_rows(batch, slice(start, start + size))
            try:
                out.append(fn(part))
            except Exception as exc:
                if not is_out_of_memory(exc) or size == 1:
                    raise
                del part
                self._halve(size)
                continue
            start += size
        return out[0] if len(out) == 1 else torch.cat(out)

    def _halve(self, size: int) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.chunk = max(1, size // 2)
        self.halvings += 1
        notice_once("oom", f"out of memory encoding {size} rows at once: continuing in chunks of {self.chunk} "
                           "(pass a smaller batch_size to avoid the retry)", "batch_size")
