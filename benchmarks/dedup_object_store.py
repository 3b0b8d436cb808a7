"""`pairclean dedup` from and to an object store against the same dedup on disk, one run: a real S3 API
(moto's server on 127.0.0.1) holding `benchmarks/dedup_scale.py`'s synthetic clip-retrieval layout
of N rows and its scores file.

    python benchmarks/dedup_object_store.py --rows 200000 --json dedup-s3.json

Runs, each in a fresh process with `--threads 1`:
    pairclean dedup DIR --scores scores.parquet --out disk.parquet
    pairclean dedup s3://B/emb --scores s3://B/scores.parquet --out s3://B/dedup.parquet   (first: mirrors fetched)
    the same again                                                                          (mirrors reused)
and reports each one's wall time, the bytes mirrored, and whether the rows are the disk run's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).parent))
from dedup_scale import generate  # noqa: E402 - the benchmark beside this one


def run(argv: list[str], env: dict) -> float:
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pairclean", "dedup", *argv, "--threads", "1"], capture_output=True,
                          text=True, env=env)
    if done.returncode:
        raise SystemExit(f"dedup failed: {done.stderr[-800:]}")
    return round(time.perf_counter() - began, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--json")
    args = parser.parse_args()

    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server's request log

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    with tempfile.TemporaryDirectory(prefix="pairclean-dedup-s3-") as tmp:
        tmp = Path(tmp)
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://{host}:{port}",
               "PAIRCLEAN_CACHE_DIR": str(tmp / "cache"), "OMP_NUM_THREADS": "1"}
        os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
        generate(tmp / "data" / "emb", args.rows, args.dim)
        client = boto3.client("s3")
        client.create_bucket(Bucket="bench")
        began, uploaded = time.perf_counter(), 0
        for path in sorted((tmp / "data").rglob("*")):
            if path.is_file():
                client.upload_file(str(path), "bench", path.relative_to(tmp / "data").as_posix())
                uploaded += path.stat().st_size
        upload_seconds = round(time.perf_counter() - began, 2)
        disk = run([str(tmp / "data" / "emb"), "--scores", str(tmp / "data" / "scores.parquet"),
                    "--out", str(tmp / "disk.parquet")], env)
        store = ["s3://bench/emb", "--scores", "s3://bench/scores.parquet"]
        first = run([*store, "--out", "s3://bench/dedup-1.parquet"], env)
        second = run([*store, "--out", "s3://bench/dedup-2.parquet"], env)
        local = pq.read_table(tmp / "disk.parquet", columns=["key", "cluster", "group_id", "kept"]).to_pylist()
        same = []
        for name in ("dedup-1.parquet", "dedup-2.parquet"):
            client.download_file("bench", name, str(tmp / name))
            same.append(pq.read_table(tmp / name, columns=["key", "cluster", "group_id", "kept"]).to_pylist() == local)
        mirrored = sum(p.stat().st_size for p in (tmp / "cache" / "mirrors").rglob("*") if p.is_file())
        report = {"rows": args.rows, "bytes_in_store": uploaded, "upload_seconds": upload_seconds,
                  "disk_seconds": disk, "store_first_seconds": first, "store_again_seconds": second,
                  "bytes_mirrored": mirrored, "rows_equal": same}
    server.stop()
    print(f"{args.rows:,} rows ({uploaded / 1e6:,.0f} MB in the store): on disk {disk} s; from and to the store "
          f"{first} s (mirrors fetched: {mirrored / 1e6:,.0f} MB), {second} s again (mirrors reused); rows equal "
          f"to the disk run's: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
