"""torch.compile with an eager fallback: a tower that cannot be compiled here runs eagerly, said once.

A compiled tower is fastest when it sees few input shapes: each new shape costs a compilation (or
makes torch fall back to a dynamic-shape graph), and on CUDA each one is a CUDA graph of its own.
So a compiled model's batches are padded to the most rows its inputs have seen (`RowPadding`: a
group's last, partial batch runs at the full batch's shape), and on CUDA the towers run as CUDA
graphs (torch's "reduce-overhead" mode), whose replay costs the host one launch instead of one per
op: on the H100 the eager towers' dispatch held the main thread 62 ms a batch of 1,024, about
three times the GPU arithmetic ViT-B-32 needs for it (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from pairclean.backends.oom import is_out_of_memory
from pairclean.ops.notices import notice_once


def pad_rows(batch: torch.Tensor, rows: int, value: int = 0) -> torch.Tensor:
    """`batch` with rows of `value` appended up to `rows`, in its own memory layout (channels last stays so)."""
    missing = rows - batch.shape[0]
    if missing <= 0:
        return batch
    return torch.nn.functional.pad(batch, (0, 0) * (batch.dim() - 1) + (0, missing), value=value)


class RowPadding:
    """The most rows each input of a compiled model has seen: its batches are padded to that many
    (rows of zeros, dropped from the output), so a partial batch costs no compilation of its own.
    After an out-of-memory the caller goes on in smaller chunks: `reset`, and they set the size."""

    def __init__(self):
        self.rows: dict[str, int] = {}

    def target(self, name: str, rows: int) -> int:
        self.rows[name] = max(self.rows.get(name, 0), rows)
        return self.rows[name]

    def reset(self) -> None:
        self.rows.clear()


class CompiledOrEager:
    """torch.compile(fn), falling back to eager `fn` (once, with a notice) if compiling fails.

    On CUDA it runs as CUDA graphs; each call then starts a step of its own and its output is
    copied out before a later call can overwrite it. Compilation happens lazily on the first
    call, so that is where failures show up: a missing C++ compiler on CPU, an unsupported op, an
    old GPU. `active`: still compiled (not fallen back); `fallback`: why it fell back (the error's
    first line), what a benchmark reports beside a `compile` figure (`state`).
    """

    def __init__(self, fn: Callable, name: str, device: torch.device, dynamic: bool | None = None):
        self.eager = fn
        self.name = name
        self.graphs = device.type == "cuda"
        self.fallback: str | None = None
        try:
            self.compiled = torch.compile(fn, dynamic=dynamic, mode="reduce-overhead" if self.graphs else None)
        except Exception as exc:  # torch.compile itself refuses (e.g. unsupported Python)
            self._give_up(exc)

    @property
    def active(self) -> bool:
        return self.compiled is not None

    @property
    def state(self) -> str:
        """`compiled`, or `eager after: <why compiling failed>`."""
        return "compiled" if self.active else f"eager after: {self.fallback}"

    def _give_up(self, exc: BaseException) -> None:
        self.compiled = None
        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        self.fallback = f"{type(exc).__name__}: {first}"
        notice_once(f"compile-{self.name}", f"torch.compile failed for the {self.name} tower, running it eagerly: {first}")

    def __call__(self, *args):
        if self.compiled is not None:
            try:
                if not self.graphs:
                    return self.compiled(*args)
                torch.compiler.cudagraph_mark_step_begin()
                return self.compiled(*args).clone()
            except Exception as exc:
                if is_out_of_memory(exc):
                    raise
                self._give_up(exc)
        return self.eager(*args)


def tower_state(tower: Any) -> str:
    """How a tower runs: a `CompiledOrEager`'s `state`, else `eager` (compiling not asked)."""
    return tower.state if isinstance(tower, CompiledOrEager) else "eager"
