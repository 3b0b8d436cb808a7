"""Scoring with more than one process on one GPU: `pairclean score` alone, then under torchrun with
RANKS ranks sharing the device, on the same shards; each whole command timed, the rows compared.

    python benchmarks/ranks_per_gpu.py SHARDS --model ViT-B-32 --precision bf16 --batch-size 1024 \
        --workers 14 --decode gpu --ranks 2 --json ranks.json      # on a GPU machine (gpu_figures.sh runs it)
    python benchmarks/ranks_per_gpu.py SHARDS --model pairclean-tiny --device cpu --batch-size 32 --workers 2   # anywhere

Why: with `--decode gpu` one process's host side is the bound on a GPU (one prefetching thread, one
nvJPEG decoder behind torchvision's process-wide lock, one interpreter dispatching the towers: the
H100 ran 38% busy, session 14). Ranks beyond a node's GPUs share them (`ops.distributed.gpu_of_rank`,
a gloo group), so each runs that host side once more and the GPU takes their kernels in turn.
The workers are split between the ranks (`--workers` in all). Reports, per way: the whole command's
seconds and pairs/s, the scoring loop's pairs/s as the command prints it (under torchrun: the ranks' mean loop time), and
whether every row's `sim` equals the single process's (they must: the batches are the same).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb

from pairclean.scorefile.contract import read_summary

THROUGHPUT = re.compile(r"^throughput\s+([\d,.]+) pairs/s", re.MULTILINE)  # the score command's line (rank 0's)


def run(command: list[str], log: Path) -> float:
    started = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seconds = time.perf_counter() - started
    if done.returncode:
        tail = log.read_text().splitlines()[-3:]
        raise SystemExit(f"{' '.join(command[:6])} ... failed (rc {done.returncode}): {' | '.join(tail)}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shards")
    parser.add_argument("--model", default="ViT-B-32")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=14, help="DataLoader workers in all, split between the ranks")
    parser.add_argument("--decode", default="gpu")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    common = ["score", args.shards, "--model", args.model, "--pretrained", "none", "--device", args.device,
              "--precision", args.precision, "--batch-size", str(args.batch_size), "--decode", args.decode,
              "--beta-mode", "shuffled", "--overwrite"]
    report: dict = {"config": vars(args), "ways": {}}
    with tempfile.TemporaryDirectory(prefix="pairclean-ranks-") as tmp:
        work = Path(tmp)
        ways = {"one process": [sys.executable, "-m", "pairclean", *common, "--workers", str(args.workers)],
                f"{args.ranks} ranks": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                        f"--nproc_per_node={args.ranks}", "-m", "pairclean", *common,
                                        "--workers", str(max(1, args.workers // args.ranks))]}
        for way, command in ways.items():
            out = work / f"{way.replace(' ', '-')}.parquet"
            seconds = run([*command, "--out", str(out)], work / f"{way.replace(' ', '-')}.log")
            summary = read_summary(out)
            loop = THROUGHPUT.search((work / f"{way.replace(' ', '-')}.log").read_text())
            loop_rate = float(loop[1].replace(",", "")) if loop else None
            report["ways"][way] = {"whole_command_seconds": seconds, "pairs": summary.pairs,
                                   "whole_command_pairs_per_second": summary.pairs / seconds,
                                   "scoring_loop_pairs_per_second": loop_rate, "out": out.name}
            print(f"{way:12} {seconds:7.1f} s whole command, {summary.pairs / seconds:8,.0f} pairs/s; "
                  f"scoring loop {loop_rate or 0:8,.0f} pairs/s", flush=True)
        one, many = (work / report["ways"][w]["out"] for w in ways)
        with duckdb.connect() as con:
            differ, rows = con.execute(
                "SELECT count(*) FILTER (WHERE a.sim IS DISTINCT FROM b.sim), count(*) "
                "FROM read_parquet(?) a FULL JOIN read_parquet(?) b USING (key)", [str(one), str(many)]).fetchall()[0]
    report["rows"], report["rows_whose_sim_differs"] = rows, differ
    first, second = report["ways"].values()
    report["whole_command_speedup"] = first["whole_command_seconds"] / second["whole_command_seconds"]
    print(f"rows {rows}, sim differing {differ}; {args.ranks} ranks / one process, whole command: "
          f"{report['whole_command_speedup']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if differ:
        raise SystemExit(f"{differ} of {rows} rows differ between one process and {args.ranks} ranks")


if __name__ == "__main__":
    main()
