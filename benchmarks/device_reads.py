"""Reads of device values back to the host in one `pairclean` run, counted on any machine (a CPU proxy for the
host syncs of a CUDA run: each waits for all the GPU work queued before it).

Every tensor the pipeline's `DeviceFeed` hands on (what a CUDA run copies to the device: a TokenBatch's `ends` stay
in host memory, as its `to` keeps them) and every model weight is marked, and so is everything computed from them
(`ops.measure.DeviceReads`); the reads of marked tensors are counted by the pairclean line that issued them.

    python benchmarks/device_reads.py score web/web-000000.tar --out /tmp/r.parquet --overwrite \\
        --model pairclean-tiny --pretrained none --device cpu --batch-size 256 --workers 1 --beta-mode fixed --beta 0
"""

from __future__ import annotations

import sys
from dataclasses import fields, is_dataclass

import torch

import pairclean.scoring.pipeline as pipeline
import pairclean.training.trainer as trainer
from pairclean.backends.feed import DeviceFeed
from pairclean.backends.inputs import TokenBatch
from pairclean.bench.measure import DeviceReads


def fed_tensors(value):
    """The tensors of a batch value that a CUDA run's DeviceFeed would copy to the device."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from fed_tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from fed_tensors(v)
    elif isinstance(value, TokenBatch):
        yield value.tokens
    elif is_dataclass(value):
        for f in fields(value):
            yield from fed_tensors(getattr(value, f.name))


def main(argv: list[str]) -> None:
    reads = DeviceReads()

    class MarkingFeed(DeviceFeed):
        def __call__(self, value):
            reads.mark(*fed_tensors(value))
            return super().__call__(value)

    pipeline.DeviceFeed = trainer.DeviceFeed = MarkingFeed
    from pairclean.cli import main as cli

    sys.argv = ["pairclean", *argv]
    code = 0
    with reads:
        try:
            cli()
        except SystemExit as exc:
            code = exc.code or 0
    print(f"reads of device values back to the host: {reads.reads}")
    for site, n in reads.sites.most_common():
        print(f"{n:8d}  {site}")
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
