"""Scoring from precomputed embeddings: pairs/s on random unit vectors, and memory vs file size.

Writes N random unit vectors per side (default 1,000,000 x 512, float16 as clip-retrieval stores
them) in clip-retrieval's layout as ONE file pair, and a second data set of a quarter of the rows,
then scores each in a separate process, as `pairclean score DIR --from-embeddings --beta-mode
fixed --beta 0` does (through the API, to read the timings back), and reports per run:

  scoring pairs/s  the scoring loop (read batches, cosine + norm check, commit parts) = the
                   summary's pairs_per_second;
  total pairs/s    the whole command (start-up, finalize: GMM on up to 1M values, output write);
  pairs/CPU-s      pairs per CPU-second (user + system, all threads) of the scoring loop, and of
                   the whole process: what the work costs independently of how busy the
                   machine's cores were (2 free cores give at most twice the loop's figure);
  peak RSS         the scoring process's resident high-water mark (the kernel's VmHWM, exact,
                   reported by the process itself at its end; it has no worker processes): it
                   must not grow with the file (4x the rows). Both runs fit the GMM on the same bounded
                   sample (--gmm-sample, default 200,000), so that the comparison is about
                   reading and scoring, whose memory is bounded by blocks and by a unit's
                   columns (262,144 rows), not by the file.

    python benchmarks/embeddings_throughput.py                 # 1M x 512 float16
    python benchmarks/embeddings_throughput.py --dtype float32 --workdir /tmp/emb-bench
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from pairclean.bench.measure import high_water_rss_mib
from pairclean.data.embeddings import write_embeddings

GENERATE_ROWS = 1 << 16  # rows generated at a time


def random_unit_vectors(rows: int, dim: int, dtype: str, seed: int):
    """(left, right) random unit vectors, `GENERATE_ROWS` at a time."""
    rng = np.random.default_rng(seed)
    for start in range(0, rows, GENERATE_ROWS):
        n = min(GENERATE_ROWS, rows - start)
        pair = []
        for _ in range(2):
            x = rng.standard_normal((n, dim), dtype=np.float32)
            x /= np.linalg.norm(x, axis=1, keepdims=True)
            pair.append(x.astype(dtype))
        yield pair


def write_one_file(directory: Path, rows: int, dim: int, dtype: str, seed: int) -> None:
    """One img_emb/text_emb file pair of `rows` rows, written block by block through a memmap."""
    staging = directory.with_name(directory.name + ".arrays")
    staging.mkdir(parents=True, exist_ok=True)
    sides = [np.lib.format.open_memmap(staging / f"{s}.npy", mode="w+", dtype=dtype, shape=(rows, dim))
             for s in ("left", "right")]
    row = 0
    for left, right in random_unit_vectors(rows, dim, dtype, seed):
        sides[0][row:row + len(left)] = left
        sides[1][row:row + len(left)] = right
        row += len(left)
    for side in sides:
        side.flush()
    write_embeddings(directory, [(np.load(staging / "left.npy", mmap_mode="r"),
                                  np.load(staging / "right.npy", mmap_mode="r"), None)], overwrite=True)
    shutil.rmtree(staging)


def child(directory: str, out: str, gmm_sample: int) -> None:
    """The measured process: score via the API (as `pairclean score --from-embeddings --beta-mode
    fixed --beta 0 --gmm-sample N` does) and print the result's summary as JSON."""
    from pairclean.data.embeddings import open_embeddings
    from pairclean.scoring.embeddings import EmbeddingScoreConfig, score_embeddings

    cfg = EmbeddingScoreConfig(beta_mode="fixed", beta=0.0, gmm_sample=gmm_sample, overwrite=True)
    result = score_embeddings(open_embeddings(directory), out, cfg)
    peak_rss_mib = high_water_rss_mib()  # not ru_maxrss: Linux carries the parent's across fork + exec
    print(json.dumps({**result.summary.to_json(), "peak_rss_mib": peak_rss_mib}))


def run_score(directory: Path, out: Path, gmm_sample: int) -> dict:
    cmd = [sys.executable, __file__, "--child", str(directory), str(out), str(gmm_sample)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate()
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"scoring failed ({proc.returncode}): {stderr.strip()}")
    summary = json.loads(stdout.strip().splitlines()[-1])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"rows": summary["pairs"], "scoring_pairs_per_s": summary["pairs_per_second"],
            "scoring_seconds": summary["scoring_seconds"],
            "scoring_pairs_per_cpu_s": summary["pairs"] / summary["scoring_cpu_seconds"], "total_seconds": seconds,
            "total_pairs_per_s": summary["pairs"] / seconds, "cpu_seconds": cpu,
            "pairs_per_cpu_second": summary["pairs"] / cpu, "peak_rss_mib": summary["peak_rss_mib"],
            "load_1m": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--dtype", choices=("float16", "float32"), default="float16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=2, help="runs per data size")
    parser.add_argument("--workdir", type=Path, help="keep the generated data here (reused when present)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--gmm-sample", type=int, default=200_000,
                        help="GMM fit sample in both runs (the same bound, so peak memory compares reading)")
    parser.add_argument("--child", nargs=3, metavar=("DIR", "OUT", "GMM_SAMPLE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return

    work = args.workdir or Path(tempfile.mkdtemp(prefix="pairclean-embbench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        sizes = {"full": args.rows, "quarter": args.rows // 4}
        for name, rows in sizes.items():
            directory = work / f"{name}-{rows}x{args.dim}-{args.dtype}"
            if not (directory / "img_emb").is_dir():
                started = time.perf_counter()
                write_one_file(directory, rows, args.dim, args.dtype, args.seed)
                print(f"wrote {rows:,} x {args.dim} {args.dtype} pairs in {time.perf_counter() - started:.1f} s "
                      f"-> {directory}", flush=True)
        results = []
        for round_ in range(args.repeat):
            for name, rows in sizes.items():
                directory = work / f"{name}-{rows}x{args.dim}-{args.dtype}"
                r = run_score(directory, work / f"scores-{name}.parquet", args.gmm_sample)
                r.update(data=name, round=round_ + 1)
                results.append(r)
                print(f"round {r['round']} {name:>7}: {r['rows']:>9,} pairs  scoring {r['scoring_pairs_per_s']:>9,.0f} "
                      f"pairs/s ({r['scoring_seconds']:.2f} s, {r['scoring_pairs_per_cpu_s']:,.0f} pairs/CPU-s)  "
                      f"whole process {r['total_pairs_per_s']:>7,.0f} pairs/s ({r['total_seconds']:.1f} s, "
                      f"{r['pairs_per_cpu_second']:,.0f} pairs/CPU-s)  peak RSS {r['peak_rss_mib']:6.1f} MiB  "
                      f"load {r['load_1m']:.1f}", flush=True)
        full = [r for r in results if r["data"] == "full"]
        quarter = [r for r in results if r["data"] == "quarter"]
        best = max(full, key=lambda r: r["scoring_pairs_per_s"])
        print(f"best scoring rate on {best['rows']:,} pairs: {best['scoring_pairs_per_s']:,.0f} pairs/s; "
              f"peak RSS full / quarter: {max(r['peak_rss_mib'] for r in full):.1f} / "
              f"{max(r['peak_rss_mib'] for r in quarter):.1f} MiB")
        if args.json:
            args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                            indent=2))
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
