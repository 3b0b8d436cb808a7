"""torch.compile with an eager fallback: a tower that cannot be compiled here runs eagerly, said once.

A compiled tower is fastest when it sees few input shapes: each new shape costs a compilation (or
makes torch fall back to a dynamic-shape graph), and on CUDA each one is a CUDA graph of its own.
So a compiled tower takes its batch padded to the most rows it has seen (a group's last, partial
batch runs at the full batch's shape), and on CUDA it runs as CUDA graphs (torch's
"reduce-overhead" mode): on the H100 the eager towers' kernel launches cost the main thread
0.061 ms a pair, as much host time as the GPU spent computing them (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Callable

import torch

from pairclean.backends.oom import is_out_of_memory
from pairclean.ops.notices import notice_once


def pad_rows(batch: torch.Tensor, rows: int) -> torch.Tensor:
    """`batch` with zero rows appended up to `rows`, in its own memory layout (channels last stays so)."""
    missing = rows - batch.shape[0]
    if missing <= 0:
        return batch
    return torch.nn.functional.pad(batch, (0, 0) * (batch.dim() - 1) + (0, missing))


class CompiledOrEager:
    """torch.compile(fn), falling back to eager `fn` (once, with a notice) if compiling fails.

    `fn(model, batch, *rest)` returns one row per batch row. Compiled, it is called with `batch`
    padded to the most rows seen so far and its output cut back, and on CUDA as CUDA graphs, whose
    output is copied out before the next call can overwrite it. Compilation happens lazily on the
    first call, so that is where failures show up: a missing C++ compiler on CPU, an unsupported
    op, an old GPU.
    """

    def __init__(self, fn: Callable, name: str, device: torch.device, dynamic: bool | None = None):
        self.eager = fn
        self.name = name
        self.graphs = device.type == "cuda"
        self.rows = 0
        try:
            self.compiled = torch.compile(fn, dynamic=dynamic, mode="reduce-overhead" if self.graphs else None)
        except Exception as exc:  # torch.compile itself refuses (e.g. unsupported Python)
            self._give_up(exc)

    def _give_up(self, exc: BaseException) -> None:
        self.compiled = None
        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        notice_once(f"compile-{self.name}", f"torch.compile failed for the {self.name} tower, running it eagerly: {first}")

    def __call__(self, model: torch.nn.Module, batch: torch.Tensor, *rest):
        if self.compiled is not None:
            try:
                return self._call_compiled(model, batch, *rest)
            except Exception as exc:
                if is_out_of_memory(exc):  # the caller goes on in smaller chunks: pad to those from now on
                    self.rows = 0
                    raise
                self._give_up(exc)
        return self.eager(model, batch, *rest)

    def _call_compiled(self, model: torch.nn.Module, batch: torch.Tensor, *rest) -> torch.Tensor:
        rows = batch.shape[0]
        self.rows = max(self.rows, rows)
        if self.graphs:  # each call is a step of its own: no output of an earlier call is read after it
            torch.compiler.cudagraph_mark_step_begin()
        out = self.compiled(model, pad_rows(batch, self.rows), *rest)[:rows]
        return out.clone() if self.graphs else out
