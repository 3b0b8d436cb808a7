"""Fault injection for the crash-consistency tests: SIGKILL this process at a named point.

`PAIRCLEAN_FAULT=NAME:N` kills the process (a real SIGKILL: no cleanup, no flush, no finally)
the N-th time execution reaches `fault_point(NAME)`. Unset, a fault point is one dict lookup.
Points: `before-rename` (every atomic write, after the temp is complete), `part-written`
(a unit's part is in place, its commit record is not), `committed` (after a commit record),
`finalize-batch` (after each record batch of the final output), `finalize-renamed` (the output
is in place, the parts directory not yet removed).
"""

from __future__ import annotations

import os
import signal

_ENV = "PAIRCLEAN_FAULT"
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
    _counts[name] = _counts.get(name, 0) + 1
    if _counts[name] == target[1]:
        os.kill(os.getpid(), signal.SIGKILL)
