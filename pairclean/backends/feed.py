"""Feeding batches to the device without stalling it: the copies of batch i+1 overlap batch i.

A DataLoader with `pin_memory` hands over page-locked batches; `DeviceFeed` copies them to the
device asynchronously on a side stream, and makes the compute stream wait for those copies only,
so the model keeps computing the batch before while the next one crosses the bus (scoring and
training both feed their batches through it). On a CPU device it hands batches on unchanged.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from pairclean.backends.base import move_batch


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
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):  # allocated from the side stream's pool: record_stream below guards it
            moved = move_batch(value, self.device)
        compute.wait_stream(self.stream)
        for tensor in device_tensors(moved):
            tensor.record_stream(compute)
        return moved
