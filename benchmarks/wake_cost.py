"""What a main process's per-batch work costs right after a long wait, against back to back (docs/benchmarks.md (d)).

The pipeline-only round's main process, fed by one worker on a 2-core machine, sleeps most of each batch waiting
for it; this measures the same small piece of work (a 256-row gather and product, a 256-row Arrow table: the kind
of thing the scorer and sink do a batch) by the thread's CPU time, run back to back and after sleeping, so the
cost of waking can be told from the cost of the work.

    python benchmarks/wake_cost.py [--sleep 0.8] [--runs 12]
"""

from __future__ import annotations

import argparse
import time

import pyarrow as pa
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sleep", type=float, default=0.8, help="seconds asleep before each timed run")
    parser.add_argument("--runs", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    table = torch.nn.functional.normalize(torch.randn(4096, 512), dim=-1)
    keys = [f"key-{i:06d}" for i in range(256)]

    def work() -> pa.Table:
        rows = torch.arange(0, 256) % 4096
        sims = (table[rows] * table[rows + 1]).sum(-1)
        return pa.table({"key": keys, "sim": sims.numpy()})

    def median_ms(sleep: float, runs: int) -> float:
        spent = []
        for _ in range(runs):
            if sleep:
                time.sleep(sleep)
            started = time.thread_time()
            work()
            spent.append(time.thread_time() - started)
        return 1000 * sorted(spent)[len(spent) // 2]

    for _ in range(5):
        work()
    for sleep, runs in ((0.0, 25 * args.runs), (args.sleep, args.runs)) * 2:
        print(f"asleep {sleep:4.2f} s before each run: median thread CPU {median_ms(sleep, runs):.3f} ms")


if __name__ == "__main__":
    main()
