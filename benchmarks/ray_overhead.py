"""`score --engine ray` against `--engine local` on one machine, same shards and settings, measured in
one run: each whole command timed, the scoring loop's pairs/s as the summary records it, the rows
compared; then the same shards on a 3-node Ray cluster on this machine (`ray.cluster_utils.Cluster`),
with the units each node scored.

    python benchmarks/ray_overhead.py SHARDS --model pairclean-tiny --device cpu --batch-size 64 --workers 1
    python benchmarks/ray_overhead.py SHARDS --model ViT-B-32 --precision bf16 --batch-size 1024 --workers 14 \
        --pretrained none --no-cluster          # on a GPU machine: one GPU, one Ray worker

Why: the Ray engine runs the same pipeline in an actor (`scoring.ray_engine`); what it adds is the
Ray start, the actor's own model build, handing groups out in chunks (each chunk a DataLoader
started anew) and the driver's wait. The ratio (ray / local pairs/s of the scoring loop, and of
the whole command) says what that costs. `--ray-workers 1` is the fair comparison on one machine:
one pipeline either way.
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

import pyarrow.parquet as pq

from pairclean.scorefile.contract import read_provenance, read_summary

THROUGHPUT = re.compile(r"^throughput\s+([\d,.]+) pairs/s", re.MULTILINE)  # the score command's summary line


def score(shards: str, out: Path, common: list[str], extra: list[str]) -> dict:
    command = [sys.executable, "-m", "pairclean", "score", shards, "--out", str(out), *common, *extra]
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seconds = time.perf_counter() - began
    if done.returncode:
        raise SystemExit(f"{' '.join(command[3:8])} ... failed (rc {done.returncode}): {done.stderr[-500:]}")
    summary, provenance = read_summary(out), read_provenance(out)
    return {"command_seconds": round(seconds, 2), "pairs": summary.pairs,
            "loop_pairs_per_second": float(THROUGHPUT.search(done.stdout).group(1).replace(",", "")),
            "command_pairs_per_second": round(summary.pairs / seconds, 1), "engine": provenance.engine,
            "units_by_node": provenance.units_by_node}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shards")
    parser.add_argument("--model", default="pairclean-tiny")
    parser.add_argument("--pretrained", default="none")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--batch-size", default="64")
    parser.add_argument("--workers", default="1")
    parser.add_argument("--decode", default="fast")
    parser.add_argument("--rounds", type=int, default=2, help="Each engine this many times, alternating.")
    parser.add_argument("--no-cluster", action="store_true", help="Skip the 3-node cluster part.")
    parser.add_argument("--json", help="Also write the figures here.")
    args = parser.parse_args()
    common = ["--model", args.model, "--pretrained", args.pretrained, "--device", args.device, "--precision",
              args.precision, "--batch-size", args.batch_size, "--workers", args.workers, "--decode", args.decode,
              "--seed", "0", "--beta-k", "64"]
    report: dict = {"settings": vars(args), "rounds": []}
    with tempfile.TemporaryDirectory(prefix="pairclean-ray-bench-") as tmp:
        tmp = Path(tmp)
        score(args.shards, tmp / "warm.parquet", common, [])  # beta into the cache, files into the page cache
        for number in range(args.rounds):
            row = {}
            for engine, extra in (("local", []), ("ray", ["--engine", "ray", "--ray-workers", "1"])):
                row[engine] = score(args.shards, tmp / f"{engine}-{number}.parquet", common, extra)
            row["same_rows"] = (pq.read_table(tmp / f"local-{number}.parquet").column("sim")
                                .equals(pq.read_table(tmp / f"ray-{number}.parquet").column("sim")))
            row["loop_ratio"] = round(row["ray"]["loop_pairs_per_second"] / row["local"]["loop_pairs_per_second"], 3)
            row["command_ratio"] = round(row["ray"]["command_pairs_per_second"]
                                         / row["local"]["command_pairs_per_second"], 3)
            report["rounds"].append(row)
            print(f"round {number}: local {row['local']['loop_pairs_per_second']:,} pairs/s "
                  f"({row['local']['command_seconds']} s), ray {row['ray']['loop_pairs_per_second']:,} pairs/s "
                  f"({row['ray']['command_seconds']} s): loop ratio {row['loop_ratio']}, whole command "
                  f"{row['command_ratio']}, rows equal {row['same_rows']}", flush=True)
        if not args.no_cluster:
            from ray.cluster_utils import Cluster

            cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
            for _ in range(2):
                cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            try:
                result = score(args.shards, tmp / "cluster.parquet", common,
                               ["--engine", "ray", "--ray-address", cluster.address])
            finally:
                cluster.shutdown()
            report["three_nodes"] = result
            print(f"3 nodes: {result['loop_pairs_per_second']:,} pairs/s ({result['command_seconds']} s), units by "
                  f"node: {result['units_by_node']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
