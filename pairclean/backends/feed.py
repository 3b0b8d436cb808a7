"""Feeding batches to the device without stalling it: the copies of batch i+1 overlap batch i.

A DataLoader with `pin_memory` hands over page-locked batches; `DeviceFeed` copies them to the
device asynchronously on a side stream, and makes the compute stream wait for those copies only,
so the model keeps computing the batch before while the next one crosses the bus (training feeds
its batches through it, and decodes its JPEGs there with `--decode gpu`). On a CPU device it hands
batches on unchanged.

`HostCopies` is the way back: results copied to the host as they are queued, read once an event
says the work before them is done - never a wait for all the device's queued work, which a
scalar read or a blocking copy is.

`DevicePrefetcher` goes one step further for work the host must wait for: it prepares batch i+1
(copies and device preprocessing, where torchvision's nvJPEG decode blocks until the batch is
decoded) in a thread of its own, on a side stream, while the main thread queues batch i's model
(scoring on CUDA).
"""

from __future__ import annotations

import queue
import threading
from contextlib import nullcontext
from typing import Any, Callable, Iterable, Iterator

import torch

from pairclean.backends.base import move_batch
from pairclean.ops.records import Keyed


def device_tensors(value: Any) -> Iterator[torch.Tensor]:
    """The CUDA tensors inside a batch value (tensors, dicts, lists, records such as ImageBatch)."""
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from device_tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from device_tensors(v)
    elif hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:
            yield from device_tensors(getattr(value, name))


class DeviceFeed:
    """Moves batch values to `device`: on CUDA with asynchronous copies on a side stream that the
    compute stream then waits for (and whose memory the caching allocator keeps until the compute
    stream is done with it); elsewhere a no-op."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self, value: Any) -> Any:
        if self.stream is None:
            return value
        return self.run(move_batch, value, self.device)

    def run(self, fn: Callable, *args) -> Any:
        """`fn(*args)` queued on the side stream (on CUDA; called as is elsewhere), its device
        tensors handed to the compute stream as the copies are: device preprocessing of the next
        batch (a decode, a resize) overlaps the compute stream's work on the one before."""
        if self.stream is None:
            return fn(*args)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):  # allocated from the side stream's pool: record_stream below guards it
            out = fn(*args)
        compute.wait_stream(self.stream)
        for tensor in device_tensors(out):
            tensor.record_stream(compute)
        return out


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """An asynchronous copy into page-locked host memory (torch's caching host allocator); the
    tensor itself when it is already on the host."""
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


class HostCopies:
    """Device values on their way to the host: each copied asynchronously as it is queued, read
    through `wait()`, which waits (a CUDA event) only for the work queued before the copies. A
    scalar read (`float(loss)`, `.item()`) or a blocking `.cpu()` waits for everything queued on
    the stream instead - the batch or step queued after it too - and the device then idles until
    the host has queued the next one. On a CPU device the values are the tensors themselves.

    The event is a blocking one: the waiting thread sleeps until the device signals it. A default
    event's `synchronize()` spins (CUDA's automatic scheduling spins where the process has fewer
    contexts than cores), holding a core the DataLoader's workers and the prefetching thread need
    for as long as the device computes - on the H100 figures, most of each batch."""

    def __init__(self, tensors: dict[str, torch.Tensor | None] | None = None):
        tensors = {name: t for name, t in (tensors or {}).items() if t is not None}
        self.values = {name: to_host(t.detach()) for name, t in tensors.items()}
        self.ready = None
        if any(t.is_cuda for t in tensors.values()):
            self.ready = torch.cuda.Event(blocking=True)
            self.ready.record()

    def wait(self) -> Keyed[str, torch.Tensor]:
        """The values in host memory, once the device has written them."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.values


_DONE = object()


class DevicePrefetcher:
    """Iterates `prepare(batch)` over `batches`; `threaded`: in a background thread (on CUDA, on a
    side stream), up to `depth` prepared batches ahead of the consumer, so preparation that blocks
    the host (a library's synchronous decode) overlaps the model on the batch before.

    Each prepared batch reaches the consumer with the compute stream made to wait for the side
    stream's work, and its device tensors recorded on the compute stream (the caching allocator
    keeps their memory until the compute stream is done with them). An exception in the thread is
    raised in the consumer, at the batch where it happened. The iterator of `batches` is made here,
    in the consumer's thread (a DataLoader sets its signal handlers only from the main thread).
    `held`: the device tensors of a prepared batch (default: found by walking it). `warm_up`: run
    in the thread before it takes the first batch (first-call costs, paid while the batches' source
    starts: a DataLoader's workers preparing their first batches)."""

    def __init__(self, batches: Iterable, prepare: Callable[[Any], Any], device: torch.device, threaded: bool,
                 depth: int = 1, held: Callable[[Any], Iterable[torch.Tensor]] = device_tensors,
                 warm_up: Callable[[], None] | None = None):
        self.batches, self.prepare, self.device, self.threaded = batches, prepare, device, threaded
        self.depth, self.held, self.warm_up = depth, held, warm_up

    def __iter__(self) -> Iterator:
        if not self.threaded:
            for batch in self.batches:
                yield self.prepare(batch)
            return
        source = iter(self.batches)
        ready: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        cuda = self.device.type == "cuda"
        stream = torch.cuda.Stream(self.device) if cuda else None  # made here: its device has the consumer's index

        def hand_over(item) -> bool:
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def work() -> None:
            try:
                with torch.cuda.device(stream.device) if cuda else nullcontext(), \
                        torch.cuda.stream(stream) if cuda else nullcontext():
                    prepare_all()
            except BaseException as exc:  # handed to the consumer, which raises it
                hand_over(exc)
                return
            hand_over(_DONE)

        def prepare_all() -> None:
            if self.warm_up is not None:
                self.warm_up()
            for batch in source:
                if stop.is_set():
                    return
                batch = self.prepare(batch)
                event = None
                if cuda:
                    event = torch.cuda.Event()
                    event.record(stream)
                if not hand_over((batch, event)):
                    return

        thread = threading.Thread(target=work, name="pairclean-device-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                item = ready.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                batch, event = item
                if event is not None:
                    compute = torch.cuda.current_stream(self.device)
                    compute.wait_event(event)
                    for tensor in self.held(batch):
                        tensor.record_stream(compute)
                yield batch
        finally:
            stop.set()
            thread.join(timeout=5)  # a thread still waiting for its source ends with the process (daemon)

