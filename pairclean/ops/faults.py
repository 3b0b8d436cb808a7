"""Fault injection for the crash-consistency tests: SIGKILL this process at a named point.

`PAIRCLEAN_FAULT=NAME:N` kills the process (a real SIGKILL: no cleanup, no flush, no finally)
the N-th time execution reaches `fault_point(NAME)`. Unset, a fault point is one dict lookup.
Points: `before-rename` (every atomic write, after the temp is complete), `part-written`
(a unit's part is in place, its commit record is not), `committed` (after a commit record),
`finalize-batch` (after each record batch of the final output), `finalize-renamed` (the output
is in place, the parts directory not yet removed), `uploaded` (after each object of a folder
written whole to an object store). `PAIRCLEAN_FAULT_RANK=R` limits the kill to
the torchrun rank R (the others run on), to kill one rank of a job.

`PAIRCLEAN_SLOW=R:SECONDS` makes rank R sleep SECONDS at every `slow_point` (after each scored
batch): a slow or contended rank, for the work-claiming tests and benchmark.
"""

from __future__ import annotations

import os
import signal
import time

_ENV = "PAIRCLEAN_FAULT"
_RANK_ENV = "PAIRCLEAN_FAULT_RANK"
_SLOW_ENV = "PAIRCLEAN_SLOW"
_counts: dict[str, int] = {}


def _target() -> tuple[str, int] | None:
    spec = os.environ.get(_ENV)
    if not spec:
        return None
    name, _, count = spec.rpartition(":")
    return (name, int(count)) if name and count.isdigit() else None


def fault_point(name: str) -> None:
    target = _target()
    if target is None or target[0] != name:
        return
    if os.environ.get(_RANK_ENV, _rank()) != _rank():
        return
    _counts[name] = _counts.get(name, 0) + 1
    if _counts[name] == target[1]:
        os.kill(os.getpid(), signal.SIGKILL)


def _rank() -> str:
    return os.environ.get("RANK", "0")


def slow_point() -> None:
    """Where a rank named by PAIRCLEAN_SLOW sleeps (after each scored batch)."""
    spec = os.environ.get(_SLOW_ENV)
    if spec:
        rank, _, seconds = spec.partition(":")
        if rank == _rank():
            time.sleep(float(seconds))
