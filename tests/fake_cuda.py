"""CUDA's streams and events stood in for on a machine without a GPU, and a check of the order a
device would run queued work in (used with `FakeTensorMode`, whose CUDA tensors run CUDA's device
and dtype checks but no kernels).

`FakeStreams.install(monkeypatch)` replaces `torch.cuda.Stream`, `Event`, `current_stream`,
`stream`, `device` and `Tensor.record_stream`: each stream counts the work queued on it (`queued`)
and how far into every other stream it has waited (`wait_stream`, `wait_event`); the current stream
is per thread, as CUDA's is. `StreamOrder`, a dispatch mode, queues every op on CUDA tensors on the
current stream, tags what it makes with (stream, position), and records a violation when an op reads
a tensor made on another stream the current one has not waited for (a missing `wait_stream` or
`wait_event`: the read could see the memory before it is written) or one allocated on another
stream without `record_stream` for the reading stream (its memory could be handed out again while
the read is still queued). A host wait (`Event.synchronize`) is recorded with whether it blocks.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary


class Stream:
    def __init__(self, device=None, name: str = "side", **kwargs):
        self.device, self.name = torch.device("cuda"), name
        self.queued = 0
        self.seen: dict[Stream, int] = {}
        self.cuda_stream = id(self)

    def __repr__(self) -> str:
        return f"<stream {self.name}>"

    def wait_stream(self, other: "Stream") -> None:
        self.seen[other] = max(self.seen.get(other, 0), other.queued)

    def wait_event(self, event: "Event") -> None:
        if event.stream is not None:
            self.seen[event.stream] = max(self.seen.get(event.stream, 0), event.at)

    def sees(self, other: "Stream", at: int) -> bool:
        return other is self or self.seen.get(other, 0) >= at


class Event:
    def __init__(self, blocking: bool = False, enable_timing: bool = False, interprocess: bool = False):
        self.blocking = blocking
        self.stream: Stream | None = None
        self.at = 0

    def record(self, stream: Stream | None = None) -> None:
        self.stream = stream if stream is not None else FakeStreams.active.current()
        self.at = self.stream.queued

    def synchronize(self) -> None:
        FakeStreams.active.host_waits.append(self)

    def query(self) -> bool:
        return True


@dataclass
class _Made:
    """Where a tensor's memory was allocated and which streams were recorded as using it."""

    stream: Stream
    recorded: set = field(default_factory=set)


class FakeStreams:
    """The stand-ins, installed for one test; `active` is the installed one."""

    active: "FakeStreams"

    def __init__(self):
        self.default = Stream(name="compute")
        self.local = threading.local()
        self.host_waits: list[Event] = []
        self.made = WeakTensorKeyDictionary()  # tensor -> (its memory's _Made, the stream that wrote it last, position)

    def current(self) -> Stream:
        return getattr(self.local, "stream", self.default)

    def install(self, monkeypatch) -> "FakeStreams":
        FakeStreams.active = self
        streams = self

        @contextlib.contextmanager
        def use(stream):
            before = streams.current()
            streams.local.stream = stream if stream is not None else before
            try:
                yield
            finally:
                streams.local.stream = before

        def record_stream(tensor, stream):
            if tensor in streams.made:
                streams.made[tensor][0].recorded.add(stream)

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams.current())
        monkeypatch.setattr(torch.cuda, "stream", use)
        monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
        monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
        return self


class StreamOrder(TorchDispatchMode):
    """Queues each op on CUDA tensors on the current fake stream and checks what it reads (see the
    module's docstring); `violations` says what would race on a device."""

    def __init__(self, streams: FakeStreams, devices: tuple[str, ...] = ("cuda",)):
        super().__init__()
        self.streams, self.devices = streams, devices  # the devices whose tensors stand for device memory
        self.violations: list[str] = []
        self.host = WeakTensorKeyDictionary()  # a copy to the host -> (the stream it was queued on, position)

    def host_ready(self, value: torch.Tensor) -> bool:
        """Whether the host waited (an event's `synchronize`) for the copy that wrote `value`."""
        stream, at = self.host[value]
        return any(e.stream is stream and e.at >= at for e in self.streams.host_waits)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "prim":  # a tensor's metadata (`prim.device`), nothing queued
            return func(*args, **kwargs)
        tensors = lambda value: [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
        on_device = lambda found: [t for t in found if t.device.type in self.devices]
        inputs, name = on_device(tensors((args, kwargs))), func.overloadpacket.__name__
        out = func(*args, **kwargs)
        outputs = on_device(tensors(out))
        if inputs and not outputs:  # a copy to the host: what the host may read once it waited for it
            for value in tensors(out):
                self.host[value] = (self.streams.current(), self.streams.current().queued + 1)
        if not inputs and not outputs:
            return out
        stream, made = self.streams.current(), self.streams.made
        for tensor in inputs:
            if tensor not in made:
                continue
            memory, writer, at = made[tensor]
            if not stream.sees(writer, at):
                self.violations.append(f"{name} on {stream.name} reads what {writer.name} wrote, without a wait")
            if memory.stream is not stream and stream not in memory.recorded:
                self.violations.append(f"{name} on {stream.name} uses memory of {memory.stream.name} without record_stream")
        stream.queued += 1
        for tensor in outputs:
            if tensor in made:  # written in place: its memory stays where it was allocated
                made[tensor] = (made[tensor][0], stream, stream.queued)
                continue
            base = next((made[i][0] for i in inputs if i in made), None) if func.is_view else None
            made[tensor] = (base or _Made(stream), stream, stream.queued)
        return out
