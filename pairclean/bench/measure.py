"""Measuring a phase of work: peak memory of a process tree, GPU busy time and peak memory, CPU
seconds, the reads back from a device a CUDA run would pay for.

What `pairclean bench` (`bench.score`), the benchmarks under `benchmarks/` and the tests of the
device path read. Peak memory: this process's RSS, and PSS over the process tree (forked workers'
shared pages counted once); see PeakMemory for the sampling.
"""

from __future__ import annotations

import collections
import os
import statistics
import threading
import time
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

from pairclean.ops.records import Keyed


def _proc_kib(pid: int, filename: str, *names: str) -> Keyed[str, int]:
    """The `Name: N kB` fields `names` of /proc/PID/FILENAME in one read; {} without /proc."""
    found: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/{filename}") as fh:
            for line in fh:
                name, _, value = line.partition(":")
                if name in names:
                    found[name] = int(value.split()[0])
    except (OSError, ValueError):
        return {}
    return found


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                kids.extend(int(x) for x in fh.read().split())
    except OSError:
        pass
    return kids


def _tree(pid: int) -> list[int]:
    seen, stack = [], [pid]
    while stack:
        p = stack.pop()
        if p not in seen:
            seen.append(p)
            stack.extend(_children(p))
    return seen


def tree_pss_mib(pid: int) -> float | None:
    """PSS of `pid` and its descendants in MiB (forked workers' shared pages counted once);
    None where /proc has no smaps_rollup. Costs ~15 ms of kernel time per GB-sized process."""
    values = [_proc_kib(p, "smaps_rollup", "Pss").get("Pss") for p in _tree(pid)]
    return None if values[0] is None else sum(v for v in values if v is not None) / 1024


def high_water_rss_mib(pid: int | None = None) -> float | None:
    """The kernel's peak RSS of `pid` since it exec'd (VmHWM); None without /proc. Unlike
    ru_maxrss, which Linux carries across fork and exec, it is not raised to the parent's RSS
    at the time of the spawn (a benchmark that wrote 4.5 GB of memmaps before starting its
    child read 4.5 GB as the child's ru_maxrss)."""
    kib = _proc_kib(pid or os.getpid(), "status", "VmHWM").get("VmHWM")
    return None if kib is None else kib / 1024


class PeakMemory:
    """Peak memory of a process (tree) while the block runs, sampled in a background thread.

    `peak_rss_mib`: the process's own RSS every `interval` s (reading /proc/PID/status is free).
    `high_water_mib`: the kernel's own peak RSS of the process since exec (VmHWM), last read at
    the end of the block or the last sample before the process exited: exact for a child run
    to its end inside the block, except growth in its final `interval`.
    `peak_mib`: PSS of the process and its workers, every `pss_interval` s and at both ends
    (smaps_rollup costs the kernel ~15 ms per read, so it is sampled rarely: a peak shorter than
    that interval can be missed). Without /proc both fall back to this process's ru_maxrss.
    """

    def __init__(self, pid: int | None = None, interval: float = 0.2, pss_interval: float = 5.0):
        self.pid = pid or os.getpid()
        self.interval, self.pss_interval = interval, pss_interval
        self.peak_rss_mib: float = 0.0
        self.peak_mib: float = 0.0
        self.high_water_mib: float = 0.0
        self._last_pss = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _fallback(self) -> float | None:
        if self.pid != os.getpid():
            return None
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def _sample(self, pss: bool) -> None:
        status = _proc_kib(self.pid, "status", "VmRSS", "VmHWM")  # one read for both
        rss = status["VmRSS"] / 1024 if "VmRSS" in status else self._fallback()
        if rss is not None:
            self.peak_rss_mib = max(self.peak_rss_mib, rss)
        self.high_water_mib = max(self.high_water_mib, status.get("VmHWM", 0) / 1024)
        if pss:
            value = tree_pss_mib(self.pid)
            value = value if value is not None else self._fallback()
            if value is not None:
                self.peak_mib = max(self.peak_mib, value)
            self._last_pss = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample(time.monotonic() - self._last_pss >= self.pss_interval)

    def __enter__(self) -> "PeakMemory":
        self._sample(True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample(True)


class GpuBusy:
    """Mean GPU utilisation (NVML's share of time a kernel ran, via torch.cuda.utilization) while
    the block runs, sampled every `interval` s; `percent` is None off CUDA or without NVML."""

    def __init__(self, device: torch.device, interval: float = 0.2):
        self.device, self.interval = device, interval
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.samples.append(float(torch.cuda.utilization(self.device)))
            except Exception:  # no NVML (pynvml) here: nothing to report
                return

    @property
    def percent(self) -> float | None:
        return statistics.fmean(self.samples) if self.samples else None

    def __enter__(self) -> "GpuBusy":
        if self.device.type == "cuda":
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def cpu_seconds() -> float:
    """User + system CPU of this process and its finished children (the DataLoader workers of a
    phase are joined when it ends): a phase's CPU per pair does not depend on how busy the
    machine is, its wall time does."""
    import resource

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def gpu_peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def gpu_peak_mib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / 2**20


def _blocking_cuda_copy(func, args: tuple, kwargs: dict) -> bool:
    """A copy between the host and a CUDA device that waits for the device (no `non_blocking`)."""
    name = func.overloadpacket.__name__
    if name == "_to_copy" and kwargs.get("device") is not None and isinstance(args[0], torch.Tensor):
        devices = {args[0].device.type, torch.device(kwargs["device"]).type}
        blocking = not kwargs.get("non_blocking", False)
    elif name == "copy_" and isinstance(args[1], torch.Tensor):
        devices = {args[0].device.type, args[1].device.type}
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    else:
        return False
    return blocking and devices == {"cpu", "cuda"}


class DeviceReads(TorchDispatchMode):
    """Counts, on any machine, the reads back to the host that a CUDA run would pay for: tensors
    given to `mark` (what would live on the device: a batch's inputs once copied, a model's
    weights) and every tensor computed from them are marked, and a scalar read, `nonzero`,
    `equal` or `masked_select` of a marked tensor is counted by the pairclean line that issued it.
    On CUDA each such read waits for all the GPU work queued before it, so the host cannot queue
    the next batch meanwhile. So does a copy between the host and a CUDA device without
    `non_blocking` (`torch.tensor(values, device=cuda)`, `.to(cuda)`, `.cpu()`): counted too, where
    the tensors are CUDA ones (on fake CUDA tensors, `FakeTensorMode`, with no GPU)."""

    READS = frozenset({"_local_scalar_dense", "nonzero", "equal", "is_nonzero", "masked_select", "_unique2"})

    def __init__(self, *on_device: torch.Tensor):
        super().__init__()
        self.marked = WeakTensorKeyDictionary()
        self.sites: collections.Counter[str] = collections.Counter()
        self.mark(*on_device)

    @property
    def reads(self) -> int:
        return sum(self.sites.values())

    def mark(self, *tensors: torch.Tensor) -> None:
        for tensor in tensors:
            self.marked[tensor] = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = [a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, torch.Tensor)]
        derived = any(a in self.marked or isinstance(a, torch.nn.Parameter) for a in inputs)
        if (derived and func.overloadpacket.__name__ in self.READS) or _blocking_cuda_copy(func, args, kwargs or {}):
            ours = [f for f in traceback.extract_stack() if f"{os.sep}pairclean{os.sep}" in f.filename and f.filename != __file__]
            site = f"{ours[-1].filename.rsplit(os.sep + 'pairclean' + os.sep, 1)[1]}:{ours[-1].lineno}" if ours else "?"
            self.sites[site] += 1
        out = func(*args, **(kwargs or {}))
        if derived:
            self.mark(*(o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)))
        return out


class _Mapped(torch.utils.data.Dataset):
    def __init__(self, fn, items: list):
        self.fn, self.items = fn, items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return self.fn(self.items[index])


def in_a_worker(fn, items: list) -> list:
    """fn over items in one DataLoader worker process, set up as the runs' workers are: where a
    worker's path differs from the main process's (`data.decode.decode_plain_jpeg`), what a worker
    does, measured or checked."""
    from pairclean.ops.worker_memory import steady_worker_memory

    return list(torch.utils.data.DataLoader(_Mapped(fn, items), batch_size=None, num_workers=1,
                                            worker_init_fn=steady_worker_memory))
