"""`pairclean dedup` at scale on this machine: time and peak memory from saved embeddings, N rows.

For each `--rows N` the script writes a clip-retrieval layout directory of N pairs: image vectors
of dimension `--dim` (256 by default) as float16, drawn around 2,000 centres (so k-means has
structure to find) with 1% near-copies of earlier rows planted; the text side is a sparse .npy
of zeros (no disk blocks: an image-side dedup never reads it); metadata with a key per row; one
file triple per million rows; and a scores file (key, shard, index, sim_debiased) for `--keep
cleanest`. Then it runs, in a fresh process,

    pairclean dedup DIR --scores scores.parquet --out dedup.parquet --threads 1

and reports its wall time per stage, the rows it removed and found, and the process's exact peak
resident memory (VmHWM, which the child reads from /proc itself: ru_maxrss would carry the
generating parent's memory over at fork). 10M rows of 256-d float16 are 5.1 GB on disk.

    python benchmarks/dedup_scale.py --rows 1000000 --rows 10000000 --workdir /tmp/dedup-scale --json out.json
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

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

BLOCK = 1_000_000
CENTRES = 2000
COPIES = 0.01


def write_npy_header(path: Path, rows: int, dim: int, sparse: bool) -> int:
    """Write an .npy header for (rows, dim) float16; a sparse file is extended to its full size
    without data (zeros). The data offset."""
    with open(path, "wb") as fh:
        np.lib.format.write_array_header_1_0(fh, {"descr": np.dtype(np.float16).str, "fortran_order": False,
                                                  "shape": (rows, dim)})
        offset = fh.tell()
        if sparse:
            fh.truncate(offset + rows * dim * 2)
    return offset


def generate(directory: Path, rows: int, dim: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((CENTRES, dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    for sub in ("img_emb", "text_emb", "metadata"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    scores = pq.ParquetWriter(directory.parent / "scores.parquet",
                              pa.schema([("key", pa.string()), ("shard", pa.string()), ("index", pa.int64()),
                                         ("sim_debiased", pa.float32())]))
    for number, start in enumerate(range(0, rows, BLOCK)):
        n = min(BLOCK, rows - start)
        x = centres[rng.integers(0, CENTRES, n)] + rng.standard_normal((n, dim), dtype=np.float32) * (0.6 / np.sqrt(dim))
        copies = rng.random(n) < COPIES
        sources = rng.integers(0, n, int(copies.sum()))
        x[copies] = x[sources] + rng.standard_normal((len(sources), dim), dtype=np.float32) * (0.02 / np.sqrt(dim))
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        image = directory / "img_emb" / f"img_emb_{number}.npy"
        write_npy_header(image, n, dim, sparse=False)
        with open(image, "ab") as fh:
            fh.write(x.astype(np.float16).tobytes())
        write_npy_header(directory / "text_emb" / f"text_emb_{number}.npy", n, dim, sparse=True)
        keys = pa.array([f"{i:010d}" for i in range(start, start + n)], pa.string())
        pq.write_table(pa.table({"key": keys}), directory / "metadata" / f"metadata_{number}.parquet")
        scores.write_table(pa.table({"key": keys, "shard": pa.array([str(image)] * n, pa.string()),
                                     "index": pa.array(np.arange(n), pa.int64()),
                                     "sim_debiased": pa.array(rng.random(n, dtype=np.float32))}))
        print(f"  wrote {start + n:,} of {rows:,} rows", flush=True)
    scores.close()


def child(argv: list[str]) -> None:
    """Run `pairclean ARGV` here, then print this process's peak RSS (VmHWM) as one JSON line."""
    from pairclean.cli import main

    code = 0
    try:
        main(argv)
    except SystemExit as exc:
        code = exc.code or 0
    status = Path("/proc/self/status").read_text()
    peak = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM"))
    print(json.dumps({"peak_rss_mib": peak / 1024, "exit": code}), flush=True)
    sys.exit(code)


def disk_usage(path: Path) -> int:
    return int(subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True).stdout.split()[0])


def allocated(path: Path) -> int:
    return int(subprocess.run(["du", "-s", "--block-size=1", str(path)], capture_output=True, text=True).stdout.split()[0])


def measure(work: Path, rows: int, dim: int, keep_data: bool) -> dict:
    base = work / f"rows-{rows}"
    data = base / "emb"
    if not (data / "img_emb").is_dir():
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        started = time.perf_counter()
        generate(data, rows, dim)
        print(f"  generated in {time.perf_counter() - started:.0f} s", flush=True)
    out = base / "dedup.parquet"
    out.unlink(missing_ok=True)
    argv = ["dedup", str(data), "--scores", str(base / "scores.parquet"), "--out", str(out), "--threads", "1",
            "--overwrite"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"dedup failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    peak = json.loads(proc.stdout.strip().splitlines()[-1])["peak_rss_mib"]
    summary = json.loads(out.with_name(out.stem + ".run.json").read_text())["summary"]
    result = {"rows": rows, "dim": dim, "wall_seconds": wall, "peak_rss_mib": peak, "stages": summary["seconds"],
              "clusters": summary["clusters"], "removed": summary["removed"], "duplicate_groups": summary["duplicate_groups"],
              "image_bytes": disk_usage(data / "img_emb"), "text_bytes_allocated": allocated(data / "text_emb"),
              "output_bytes": out.stat().st_size}
    print(f"  {rows:,} rows: {wall:.0f} s, peak RSS {peak:,.0f} MiB, stages {summary['seconds']}, "
          f"{summary['clusters']:,} clusters, removed {summary['removed']:,}", flush=True)
    if not keep_data:
        shutil.rmtree(base)
    return result


def main(argv: list[str] | None = None) -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, action="append")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep-data", action="store_true", help="keep the generated embeddings (deleted by default)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dedup-scale-"))
    results = []
    for rows in args.rows or [1_000_000]:
        print(f"{rows:,} rows of dimension {args.dim}", flush=True)
        results.append(measure(work, rows, args.dim, args.keep_data))
    # the run times its four stages; the rest of the wall time is the output's finalize and the process start
    print("\n| rows | wall s | k-means / assign / index / clusters / rest s | peak RSS MiB | clusters | removed |")
    print("|---|---|---|---|---|---|")
    for r in results:
        s = r["stages"]
        rest = r["wall_seconds"] - sum(s.values())
        print(f"| {r['rows']:,} | {r['wall_seconds']:.0f} | {s['kmeans']:.0f} / {s['assign']:.0f} / {s['index']:.0f} / "
              f"{s['clusters']:.0f} / {rest:.0f} | {r['peak_rss_mib']:,.0f} | {r['clusters']:,} | {r['removed']:,} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
