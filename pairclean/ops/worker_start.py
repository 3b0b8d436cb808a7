"""DataLoader workers that start on their first batch as soon as they exist.

A DataLoader starts its workers one after another, each a fork of the main process, and asks
them for batches only once every one is started. A fork costs in proportion to the main
process's memory: from a process of 2.7 GB resident, 2 / 6 / 14 workers took 0.08-0.10 /
0.23 / 0.59-0.65 s here (from a bare interpreter 0.01-0.03 / 0.05 / 0.13 s;
docs/benchmarks.md), and the first worker sat idle through all the later forks. A worker
builds its dataset's iterator as soon as it starts (torch's fetcher does), so a dataset whose
`__iter__` returns `first_batch_at_once(batches)` builds its first batch from then on.
"""

from __future__ import annotations

import threading
from typing import Iterator, TypeVar

from torch.utils.data import get_worker_info

T = TypeVar("T")


def first_batch_at_once(batches: Iterator[T]) -> Iterator[T]:
    """`batches`, the first one built now in a thread of this worker (then handed over when the
    DataLoader asks, its error raised there); in the main process (no workers) `batches` as is."""
    if get_worker_info() is None:
        return batches
    first: list[tuple[str, object]] = []

    def build() -> None:
        try:
            first.append(("batch", next(batches)))
        except StopIteration:
            first.append(("end", None))
        except BaseException as exc:  # noqa: BLE001 - raised where the DataLoader asks for the batch
            first.append(("error", exc))

    thread = threading.Thread(target=build, name="pairclean-first-batch", daemon=True)
    thread.start()
    return _after(thread, first, batches)


def _after(thread: threading.Thread, first: list, batches: Iterator[T]) -> Iterator[T]:
    thread.join()
    kind, value = first[0]
    if kind == "error":
        raise value
    if kind == "batch":
        yield value
        yield from batches
