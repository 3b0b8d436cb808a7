"""Where a pipeline's main process spends its time (`StageMeter`), stage by stage: what
`pairclean bench score` (`bench.score`) asks the scoring pipeline to record. The rest of what
the benchmarks measure (peak memory of a process tree, GPU busy time, reads back from a device)
is `bench.measure`'s.
"""

from __future__ import annotations

import time
from typing import Iterable, Iterator

from pairclean.ops.records import JsonObject


class StageMeter:
    """Where a pipeline's main process spends its time, stage by stage: wall seconds and the main
    thread's CPU seconds per named stage (each `mark(stage)` charges the time since the previous
    mark to `stage`), the whole process's CPU seconds (its other threads included: the
    DataLoader's pin-memory thread, torch's intra-op pool), and the bytes that crossed from the
    workers.

    The steady state is what is measured: everything up to the end of the first batch (forking
    the workers, their first batch, first-call costs) is `startup`, reported apart with its
    milestones (`timed`: when the loader had started its workers, when the first batch came), and
    the per-pair figures count the later batches' pairs only. A mark costs two clock reads (about
    a microsecond); a pipeline without a meter skips them.
    """

    def __init__(self):
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.worker_bytes = 0
        self.pairs = 0
        self.process_cpu = 0.0
        self.seconds = 0.0
        self.startup = (0.0, 0.0)  # wall, process CPU seconds until the first batch was through
        self.steady = False
        self.milestones: dict[str, float] = {}  # start-up milestone -> seconds after `start`
        self._last = (0.0, 0.0)
        self._began = (0.0, 0.0)
        self._started = 0.0

    def start(self) -> None:
        self._last = (time.perf_counter(), time.thread_time())
        self._began = (self._last[0], time.process_time())
        self._started = self._last[0]

    def timed(self, batches: Iterable) -> Iterator:
        """`batches` started here, in the caller's thread (`iter()`: where a DataLoader forks its
        workers; noted as `loader started`), with `first batch received` noted from whichever thread
        takes it. Not a generator itself: a generator's body runs at its first `next()`, which the
        prefetching thread makes after its warm-up, so a metered run would start its loader only
        then and serialise what an unmetered one overlaps (the warm-up beside the workers' start)."""
        items = iter(batches)
        self.milestones.setdefault("loader started", time.perf_counter() - self._started)
        return self._received(items)

    def _received(self, items: Iterator) -> Iterator:
        for item in items:
            self.milestones.setdefault("first batch received", time.perf_counter() - self._started)
            yield item

    def mark(self, stage: str) -> None:
        now = (time.perf_counter(), time.thread_time())
        if self.steady:
            self.wall[stage] = self.wall.get(stage, 0.0) + now[0] - self._last[0]
            self.cpu[stage] = self.cpu.get(stage, 0.0) + now[1] - self._last[1]
        self._last = now

    def batch(self, pairs: int, worker_bytes: int) -> None:
        """A batch is through every stage: count it, or end the start-up with the first one."""
        if self.steady:
            self.pairs += pairs
            self.worker_bytes += worker_bytes
            return
        cpu = time.process_time()
        self.startup = (self._last[0] - self._began[0], cpu - self._began[1])
        self._began = (self._last[0], cpu)
        self.steady = True

    def stop(self) -> None:
        self.seconds = time.perf_counter() - self._began[0]
        self.process_cpu = time.process_time() - self._began[1]

    def per_pair_ms(self, seconds: dict[str, float]) -> Keyed[str, float]:
        return {stage: 1000 * value / self.pairs if self.pairs else 0.0 for stage, value in seconds.items()}

    def summary(self) -> JsonObject:
        """Per pair, in the steady state: main-process CPU ms in total and by stage (main thread;
        `other threads` is the rest of the process), wall ms by stage, bytes from the workers;
        pairs/s; and the start-up's wall and CPU seconds."""
        pairs = self.pairs or 1
        threads = max(0.0, self.process_cpu - sum(self.cpu.values()))
        return {"pairs": self.pairs, "seconds": self.seconds,
                "pairs_per_second": self.pairs / self.seconds if self.seconds > 0 else 0.0,
                "main_cpu_ms_per_pair": 1000 * self.process_cpu / pairs,
                "stages": {**self.per_pair_ms(self.cpu), "other threads": 1000 * threads / pairs},
                "stage_wall_ms_per_pair": self.per_pair_ms(self.wall),
                "worker_bytes_per_pair": self.worker_bytes / pairs,
                "startup_seconds": self.startup[0], "startup_cpu_seconds": self.startup[1],
                "startup_milestones": {**self.milestones, "first batch through": self.startup[0]}}
