"""Training throughput: one epoch of `pairclean train` against the model's own step rate.

    python benchmarks/train_throughput.py SHARDS --model ViT-B-32 --precision bf16 --batch-size 512 \
        --workers 14 --json train.json                  # on a GPU machine (benchmarks/gpu_figures.sh runs it)
    python benchmarks/train_throughput.py SHARDS --model pairclean-tiny --batch-size 64 --workers 1   # anywhere

(a) model only: plain symmetric InfoNCE steps (forward, backward, AdamW) on one real batch of the
    shards, copied to the device once and held there, repeated, each step's loss read back one step
    late as the training loop reads it (`HostCopies`): what the model can do at this batch size.
(b) end to end: `pairclean.train` (plain method, one epoch, no validation, diagnostics on as by
    default) on the same shards, its JPEGs decoded as `--decode` says (fast: PIL in the workers;
    gpu: on the device): its own pairs/s, and its data and compute seconds per step.
Prints (b)/(a); the issue's target on a GPU is >= 0.6. On CUDA each part also reports how busy
the GPU was (`gpu_utilisation`, NVML's share of time a kernel ran): where (b) falls short of (a),
whether the device waited for the host.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from pairclean.backends import load_target
from pairclean.backends.base import autocast_context, move_batch, pick_device
from pairclean.backends.feed import HostCopies
from pairclean.data.dataset import open_dataset
from pairclean.data.spec import modalities
from pairclean.bench.measure import GpuBusy
from pairclean.training.data import TrainBatches
from pairclean.training.loss import weighted_infonce
from pairclean.training.trainer import TrainConfig, train


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_only(args, dataset) -> dict:
    """Steps per second of plain InfoNCE training on one batch held on the device, the host queuing
    step i+1 before it reads step i's loss (a copy and an event: `HostCopies`), as the loop does. Its
    batch crossed from pageable memory at every step before, and every fifth step drained the queue."""
    torch.manual_seed(0)
    target = load_target(args.model, args.pretrained, device=args.device)
    left, right = modalities(dataset.spec.pair)
    batch = next(iter(TrainBatches(dataset, target.preparer, args.batch_size, seed=0)))
    inputs = [move_batch(batch["left"], target.device), move_batch(batch["right"], target.device)]  # once
    optimizer = torch.optim.AdamW([p for p in target.module.parameters() if p.requires_grad], lr=1e-5)
    behind: list[HostCopies] = []

    def step() -> None:
        with autocast_context(target.device, args.precision):
            u, v = target.encode(left, inputs[0]), target.encode(right, inputs[1])
            loss, _ = weighted_infonce(u, v, target.logit_scale())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        behind.append(HostCopies({"loss": loss}))
        if len(behind) > 1:
            behind.pop(0).wait()

    for _ in range(args.warmup_steps):
        step()
    synchronize(target.device)
    behind.clear()
    with GpuBusy(target.device) as busy:
        started, steps = time.perf_counter(), 0
        while steps < args.min_steps or time.perf_counter() - started < args.min_seconds:
            step()
            steps += 1
        synchronize(target.device)
        seconds = time.perf_counter() - started
    n = len(batch["key"])
    return {"steps": steps, "seconds": seconds, "batch": n, "pairs_per_second": steps * n / seconds,
            "device": str(target.device), "gpu_utilisation": busy.percent}


def end_to_end(args, dataset, out: Path) -> dict:
    cfg = TrainConfig(model=args.model, pretrained=args.pretrained, device=args.device, precision=args.precision,
                      decode=args.decode, batch_size=args.batch_size, workers=args.workers, epochs=1, lr=1e-5, warmup_steps=1,
                      overwrite=True, seed=0)
    called = time.perf_counter()
    with GpuBusy(pick_device(args.device)) as busy:
        result = train(dataset, out, cfg)
    record = result.epochs[0]
    return {"pairs": record["pairs"], "steps": record["steps"], "epoch_seconds": record["seconds"],
            "pairs_per_second": record["pairs_per_second"], "data_seconds_per_step": record["data_seconds_per_step"],
            "compute_seconds_per_step": record["compute_seconds_per_step"],
            "first_batch_seconds": record["first_batch_seconds"],
            "whole_call_seconds": time.perf_counter() - called, "gpu_utilisation": busy.percent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shards", nargs="+")
    parser.add_argument("--model", default="ViT-B-32")
    parser.add_argument("--pretrained", default="none")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--decode", default="fast", help="the end-to-end epoch's `decode` (gpu: JPEGs decoded on the device)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--min-steps", type=int, default=10)
    parser.add_argument("--min-seconds", type=float, default=10.0)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    dataset = open_dataset(args.shards)
    load = os.getloadavg()[0]
    report = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "torch": torch.__version__}

    def keep(**taken) -> None:  # written as each part is taken: a timeout keeps the parts measured
        report.update(taken, load=(load, os.getloadavg()[0]))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))

    ceiling = model_only(args, dataset)
    keep(model_only=ceiling)
    with tempfile.TemporaryDirectory(prefix="pairclean-train-bench-") as tmp:
        e2e = end_to_end(args, dataset, Path(tmp) / "run")
    keep(end_to_end=e2e, end_to_end_over_model_only=e2e["pairs_per_second"] / ceiling["pairs_per_second"])
    print(f"model only: {ceiling['pairs_per_second']:,.1f} pairs/s ({ceiling['steps']} steps of {ceiling['batch']} on "
          f"{ceiling['device']}); end to end: {e2e['pairs_per_second']:,.1f} pairs/s over {e2e['steps']} steps "
          f"(data {e2e['data_seconds_per_step']:.3f} s, compute {e2e['compute_seconds_per_step']:.3f} s a step, "
          f"the first batch after {e2e['first_batch_seconds']:.2f} s); "
          f"end to end / model only = {report['end_to_end_over_model_only']:.2f} (--decode {args.decode})"
          + (f"; GPU busy {ceiling['gpu_utilisation']:.0f}% / {e2e['gpu_utilisation']:.0f}%"
             if ceiling["gpu_utilisation"] is not None and e2e["gpu_utilisation"] is not None else ""))


if __name__ == "__main__":
    main()
