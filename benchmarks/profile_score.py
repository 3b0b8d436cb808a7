"""Where the main process's time goes inside `pairclean score`, op by op: torch.profiler over a run.

    python benchmarks/profile_score.py SHARDS/manifest.yaml --model ViT-B-32 --precision bf16 \
        --batch-size 1024 --workers 14 --decode gpu --device cuda --shards 3 --out prof/   # gpu_figures.sh runs it
    python benchmarks/profile_score.py SHARDS/manifest.yaml --model pairclean-tiny --batch-size 64 --device cpu --out prof/

`bench score` says which stage of the main thread costs what (receive, device preprocessing,
encode, ...); this says why: the ops, kernel launches and host-device synchronisations behind
them. One warm run first (compilation, cuDNN autotuning, cache), then a profiled run over the same
shards; each run starts its own workers, so the profiled DataLoader wait includes their start-up
(first batch). Written to OUT: profile.txt (ops by self CPU time, and by device time where there is
one), profile.json (per batch, in all and for each recording thread: kernel launches and
synchronisations with their host time, top-level aten ops, the busiest ops).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from pairclean.backends import build_estimator
from pairclean.data.dataset import as_dataset
from pairclean.ops.progress import SILENT
from pairclean.scoring.model import ScoreConfig, score

# Host calls that wait for the device (or make it wait): each one holds the main thread.
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaStreamWaitEvent")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch")


def per_batch(events, batches: int) -> dict:
    """Launches and synchronisations (count, host ms) and aten ops called from Python or a module
    (not those nested inside another aten op) per batch, over `events` (FunctionEvents)."""
    launches = [e for e in events if e.name in LAUNCHES]
    syncs = [e for e in events if e.name in SYNCS]
    aten = [e for e in events if e.name.startswith("aten::")
            and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    return {"launches": len(launches) / batches, "launch_cpu_ms": sum(e.self_cpu_time_total for e in launches) / 1000 / batches,
            "synchronisations": len(syncs) / batches, "sync_cpu_ms": sum(e.self_cpu_time_total for e in syncs) / 1000 / batches,
            "aten_ops": len(aten) / batches}


def by_thread(events, batches: int) -> dict:
    """`per_batch` for each recording thread, with its three busiest ops (which thread is which:
    the main thread runs the towers' ops, on CUDA the prefetching thread the decode and copies)."""
    threads: dict[int, list] = {}
    for e in events:
        threads.setdefault(e.thread, []).append(e)
    out = {}
    for thread, mine in sorted(threads.items()):
        own: dict[str, float] = {}
        for e in mine:
            own[e.name] = own.get(e.name, 0.0) + e.self_cpu_time_total
        top = sorted(own, key=own.get, reverse=True)[:3]
        out[thread] = {**per_batch(mine, batches), "busiest": {n: own[n] / 1000 / batches for n in top}}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("manifest")
    parser.add_argument("--model", default="ViT-B-32")
    parser.add_argument("--pretrained", default="none")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--decode", default="fast")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--shards", type=int, default=3, help="profile the first N shards")
    parser.add_argument("--rows", type=int, default=40, help="ops listed in profile.txt")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    data = as_dataset(args.manifest)
    data = as_dataset(replace(data.spec, shards=data.spec.shards[:args.shards]))
    torch.manual_seed(0)
    estimator = build_estimator("open_clip", model=args.model, pretrained=args.pretrained, device=args.device,
                                precision=args.precision, decode=args.decode, compile=args.compile)
    cfg = ScoreConfig(model=args.model, pretrained=args.pretrained, device=args.device, precision=args.precision,
                      batch_size=args.batch_size, workers=args.workers, decode=args.decode, compile=args.compile,
                      beta_mode="fixed", beta=0.0, beta_cache=False, rules=("beta",), overwrite=True, progress=SILENT)
    cuda = estimator.device.type == "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pairclean-profile-") as tmp:
        score(data, Path(tmp) / "warm.parquet", cfg, estimator=estimator)  # compile, autotune, first start
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            result = score(data, Path(tmp) / "profiled.parquet", cfg, estimator=estimator)
    events = prof.key_averages()
    pairs, batches = result.pairs_scored_now, max(result.summary.batches, 1)
    busiest = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:args.rows]
    report = {"config": vars(args), "device": str(estimator.device), "estimator": estimator.provenance(),
              "pairs": pairs, "batches": batches,
              "seconds": result.seconds, "pairs_per_second": pairs / result.seconds if result.seconds else None,
              "per_batch": per_batch(prof.events(), batches),
              "by_thread": {str(t): figures for t, figures in by_thread(prof.events(), batches).items()},
              "busiest_ops_self_cpu_ms_per_batch": {e.key: e.self_cpu_time_total / 1000 / batches for e in busiest}}
    (out / "profile.json").write_text(json.dumps(report, indent=1))
    text = [f"{pairs} pairs in {batches} batches, {report['pairs_per_second'] or 0:,.0f} pairs/s profiled; per batch: "
            + ", ".join(f"{k} {v:,.1f}" for k, v in report["per_batch"].items()),
            events.table(sort_by="self_cpu_time_total", row_limit=args.rows)]
    if cuda:
        text.append(events.table(sort_by="self_device_time_total", row_limit=args.rows))
    (out / "profile.txt").write_text("\n\n".join(text))
    print(text[0])


if __name__ == "__main__":
    main()
