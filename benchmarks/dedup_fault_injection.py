"""SIGKILL `pairclean dedup` at its commit points, damage one committed part, resume, and compare the
output with an uninterrupted run: rows lost, rows duplicated, values that differ.

The embeddings are `benchmarks/dedup_scale.py`'s synthetic layout (N rows around 2,000 centres, 1%
near-copies). Each trial is a fresh `python -m pairclean dedup` process SIGKILLed at a random commit
(`PAIRCLEAN_FAULT=committed:K`: the assignment part or a group of clusters) or while the output is
written (`finalize-batch:1`); then one committed part is damaged as `fault_injection.py --damage`
does (cut short, replaced by another unit's part, its record's row count off by one); then the same
command runs until it exits 0. The run must score the damaged unit again and give the
uninterrupted rows.

    python benchmarks/dedup_fault_injection.py --rows 20000 --trials 12 --json dedup-faults.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).parent))
from dedup_scale import generate  # noqa: E402 - the benchmarks beside this one
from fault_injection import damage  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="pairclean-dedup-faults-") as tmp:
        tmp = Path(tmp)
        generate(tmp / "data" / "emb", args.rows, 64)
        base = [sys.executable, "-m", "pairclean", "dedup", str(tmp / "data" / "emb"), "--scores",
                str(tmp / "data" / "scores.parquet"), "--threads", "1", "--group-rows", "2048"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("PAIRCLEAN_FAULT", None)
        subprocess.run([*base, "--out", str(tmp / "reference.parquet")], check=True, capture_output=True, env=env)
        reference = pq.read_table(tmp / "reference.parquet").to_pylist()
        results = []
        for trial in range(args.trials):
            out = tmp / f"trial-{trial:02d}.parquet"
            fault = "finalize-batch:1" if rng.random() < 0.2 else f"committed:{rng.randint(1, 8)}"
            killed = subprocess.run([*base, "--out", str(out)], capture_output=True,
                                    env={**env, "PAIRCLEAN_FAULT": fault})
            damaged = damage(out, rng) if killed.returncode == -9 else None
            runs = 1
            while True:
                runs += 1
                done = subprocess.run([*base, "--out", str(out)], capture_output=True, text=True, env=env)
                if done.returncode == 0:
                    break
                if runs > 4:
                    raise SystemExit(f"trial {trial}: {done.stderr[-800:]}")
            got = pq.read_table(out).to_pylist()
            want = collections.Counter((r["shard"], r["index"]) for r in reference)
            seen = collections.Counter((r["shard"], r["index"]) for r in got)
            row = {"trial": trial, "fault": fault, "killed": killed.returncode == -9, "damaged": damaged,
                   "runs": runs, "lost": sum((want - seen).values()), "duplicated": sum((seen - want).values()),
                   "identical": got == reference, "parts_left": Path(str(out) + ".parts").exists()}
            results.append(row)
            print(f"trial {trial:2d} {fault:17s} killed={row['killed']} damaged={damaged} runs={runs}: "
                  f"lost {row['lost']}, duplicated {row['duplicated']}, identical {row['identical']}", flush=True)
    tally = {"trials": len(results), "killed": sum(r["killed"] for r in results),
             "damaged": dict(collections.Counter(r["damaged"] for r in results if r["damaged"])),
             "lost": sum(r["lost"] for r in results), "duplicated": sum(r["duplicated"] for r in results),
             "identical": sum(r["identical"] for r in results), "parts_left": sum(r["parts_left"] for r in results)}
    print(json.dumps(tally, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps({"tally": tally, "trials": results}, indent=2))


if __name__ == "__main__":
    main()
