"""torch.compile with an eager fallback: a tower that cannot be compiled here runs eagerly, said once."""

from __future__ import annotations

from typing import Callable

import torch

from pairclean.backends.oom import is_out_of_memory
from pairclean.ops.notices import notice_once


class CompiledOrEager:
    """torch.compile(fn), falling back to eager `fn` (once, with a notice) if compiling fails.

    Compilation happens lazily on the first call, so that is where failures show up: a missing
    C++ compiler on CPU, an unsupported op, an old GPU.
    """

    def __init__(self, fn: Callable, name: str, dynamic: bool | None = None):
        self.eager = fn
        self.name = name
        try:
            self.compiled = torch.compile(fn, dynamic=dynamic)
        except Exception as exc:  # torch.compile itself refuses (e.g. unsupported Python)
            self._give_up(exc)

    def _give_up(self, exc: BaseException) -> None:
        self.compiled = None
        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        notice_once(f"compile-{self.name}", f"torch.compile failed for the {self.name} tower, running it eagerly: {first}")

    def __call__(self, *args):
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as exc:
                if is_out_of_memory(exc):
                    raise
                self._give_up(exc)
        return self.eager(*args)
