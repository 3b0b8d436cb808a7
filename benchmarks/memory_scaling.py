"""Peak memory of `pairclean score` on 1x and 10x the data: it must not grow with the dataset.

The 1x data is a toy world (pairclean.lab.synth.world: PNG scenes + captions); the 10x data is the
same shards hard-linked under ten names each, so it holds 10x the rows (distinct shard/index)
at no extra build time. Each run is a separate `pairclean score` process with the tiny model;
its RSS is sampled every 0.1 s, its process tree's PSS (workers' shared pages counted once)
every second, and the kernel's own peak RSS of the main process (VmHWM) is read with the samples
(not wait4's ru_maxrss: Linux carries the parent's peak across fork + exec into it).

    python benchmarks/memory_scaling.py --pairs 4000 --shard-size 500 --repeat 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pairclean.bench.measure import PeakMemory
from pairclean.lab.synth.world import build_world


def run_score(shards: Path, out: Path, args) -> dict:
    cmd = [sys.executable, "-m", "pairclean", "score", str(shards), "--out", str(out), "--overwrite",
           "--model", args.model, "--pretrained", "none", "--batch-size", str(args.batch_size),
           "--workers", str(args.workers), "--no-beta-cache"]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with PeakMemory(proc.pid, interval=0.1, pss_interval=1.0) as mem:
        _, status = os.waitpid(proc.pid, 0)
    seconds = time.perf_counter() - started
    output = proc.stdout.read()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"pairclean score failed ({proc.returncode}):\n{output[-3000:]}")
    rows = int(subprocess.run(["duckdb", "-noheader", "-list", "-c", f"SELECT count(*) FROM '{out}'"],
                              capture_output=True, text=True, check=True).stdout.strip())
    return {"rows": rows, "seconds": seconds, "peak_tree_pss_mib": mem.peak_mib,
            "peak_main_rss_mib": mem.peak_rss_mib, "main_hwm_mib": mem.high_water_mib}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=4000, help="pairs in the 1x data")
    parser.add_argument("--shard-size", type=int, default=500)
    parser.add_argument("--factor", type=int, default=10)
    parser.add_argument("--model", default="pairclean-tiny")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1, help="rounds of (1x, 10x), interleaved")
    parser.add_argument("--workdir", type=Path, default=None, help="kept if given; a temp dir otherwise")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()

    work = args.workdir or Path(tempfile.mkdtemp(prefix="pairclean-memscale-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        one = work / "x1"
        if not (one / "manifest.yaml").is_file():
            build_world(one, args.pairs, seed=0, shard_size=args.shard_size, overwrite=True)
        many = work / f"x{args.factor}"
        if not many.is_dir():
            many.mkdir()
            for copy in range(args.factor):
                for tar in sorted(one.glob("*.tar")):
                    os.link(tar, many / f"c{copy:02d}-{tar.name}")
        results = []
        for round_ in range(args.repeat):
            for name, shards in (("1x", one), (f"{args.factor}x", many)):
                r = run_score(shards, work / f"scores-{name}.parquet", args)
                r.update(data=name, round=round_ + 1, load_1m=os.getloadavg()[0])
                results.append(r)
                print(f"round {round_ + 1} {name:>4}: {r['rows']:>7,} rows  {r['seconds']:6.1f} s  "
                      f"peak tree PSS {r['peak_tree_pss_mib']:7.1f} MiB  main peak RSS {r['main_hwm_mib']:7.1f} MiB  "
                      f"load {r['load_1m']:.1f}", flush=True)
        small = [r for r in results if r["data"] == "1x"]
        big = [r for r in results if r["data"] != "1x"]
        for key in ("peak_tree_pss_mib", "main_hwm_mib"):
            a = max(r[key] for r in small)
            b = max(r[key] for r in big)
            print(f"{key}: 1x {a:.1f} MiB, {args.factor}x {b:.1f} MiB, ratio {b / a:.3f}")
        if args.json:
            args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                            indent=2))
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
