"""The figures docs/filter-query-report.md quotes for its COCO-mini caption pairs, regenerated.

Builds the doc's data (the 239 COCO-mini images, 2 captions each, a quarter of the second captions
swapped with a seeded draw: `truth.parquet` beside the shards), scores it with all-MiniLM-L6-v2 (the
`text` extra's bundled weights, offline), and prints every figure the doc's paragraph and dry-run
table quote, each read from what the commands wrote: beta, the truth confusion of each rule
(docs/queries/truth-confusion.sql), the similarities of the noisy pairs the GMM keeps, the filter's
dry run and what the filter keeps, and how long one CLI call takes to start (`pairclean --version`)
next to a filter's dry run timed in this process. Every step but the scoring is the CLI, run in this
process (`pairclean.cli.main`); the scoring is the doc's own Python lines.

    python benchmarks/filter_query_report_figures.py /path/to/shared/data/coco-mini [--work DIR]

Prints the date, the commit and the figures; nothing else is written outside `--work` (a temp
directory by default).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from pairclean.cli import main

ROOT = Path(__file__).resolve().parent.parent
WHERE = "p_clean >= 0.5 AND weight > 0"


def build(src: Path, out: Path) -> None:
    """The doc's shards and truth, as its first script writes them."""
    from pairclean.data.writer import write_shards

    recs = [json.loads(line) for line in (src / "pairs.jsonl").read_text().splitlines()]
    rng = random.Random(0)
    noisy = set(rng.sample(range(len(recs)), len(recs) // 4))
    samples = []
    for i, r in enumerate(recs):
        donor = recs[(i + rng.randrange(1, len(recs))) % len(recs)] if i in noisy else r
        samples.append({"__key__": f"{r['image_id']:012d}", "jpg": (src / r["image"]).read_bytes(),
                        "txt": r["captions"][0], "txt2": donor["captions"][1]})
    out.mkdir(parents=True)
    shards = write_shards(samples, out, prefix="coco-tt", maxcount=60)
    pq.write_table(pa.Table.from_pylist([{"key": s["__key__"], "shard": str(shards[j // 60]), "index": j % 60,
                                          "noisy": j in noisy} for j, s in enumerate(samples)]),
                   out.parent / "truth.parquet")


def cli(*argv) -> str:
    """`pairclean ARGV` in this process: its stdout."""
    sink = io.StringIO()
    with redirect_stdout(sink):
        try:
            main([str(a) for a in argv])
        except SystemExit as exc:
            if exc.code:
                raise
    return sink.getvalue()


def main_figures(src: Path, work: Path) -> None:
    from pairclean.data.dataset import open_dataset
    from pairclean.scoring.model import ScoreConfig, score

    build(src, work / "shards")
    scores = work / "scores.parquet"
    score(open_dataset(str(work / "shards"), pair="text-text"), scores,
          ScoreConfig(backend="sentence-transformers", model="all-MiniLM-L6-v2", pretrained="none", workers=0,
                      batch_size=64))
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"{time.strftime('%Y-%m-%d')}, commit {commit or 'unknown'}")
    con = duckdb.connect()
    con.execute(f"CREATE VIEW scores AS SELECT * FROM read_parquet('{scores}')")
    con.execute(f"CREATE VIEW truth AS SELECT * FROM read_parquet('{work / 'truth.parquet'}')")
    pairs, noisy = con.execute("SELECT count(*), count(*) FILTER (WHERE noisy) FROM truth").fetchall()[0]
    meta = json.loads(pq.read_schema(scores).metadata[b"pairclean"])
    print(f"{pairs} pairs, {noisy} noisy; beta = {meta['beta']:.4f} +- {meta['beta_std']:.4f} "
          f"({meta['beta_mode']}, K = {meta['beta_k']})")
    print(cli("query", scores, "-f", ROOT / "docs" / "queries" / "truth-confusion.sql", "--truth",
              work / "truth.parquet"), end="")
    kept = con.execute("SELECT count(*), min(s.sim), max(s.sim) FROM scores s JOIN truth t USING (key) "
                       "WHERE t.noisy AND NOT s.gmm_noisy").fetchall()[0]
    print(f"noisy pairs the GMM keeps: {kept[0]}, sim {kept[1]:.2f} ... {kept[2]:.2f}")
    started = time.perf_counter()
    print(cli("filter", work / "shards", "--scores", scores, "--where", WHERE, "--top-fraction", "0.7", "--dry-run"),
          end="")
    dry = time.perf_counter() - started
    started = time.perf_counter()
    print(cli("filter", work / "shards", "--scores", scores, "--where", WHERE, "--out", work / "clean",
              "--shard-size", "50"), end="")
    wrote = time.perf_counter() - started
    kept_noisy = con.execute(f"SELECT count(*) FILTER (WHERE t.noisy), count(*) FROM scores s JOIN truth t "
                             f"USING (key) WHERE {WHERE}").fetchall()[0]
    print(f"kept pairs truly noisy: {kept_noisy[0]} of {kept_noisy[1]}")
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pairclean", "--version"], check=True, capture_output=True)
    print(f"in this process: dry run {dry:.2f} s, filter {wrote:.2f} s; "
          f"a CLI call's start (pairclean --version): {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("coco_mini", type=Path, help="shared/data/coco-mini")
    parser.add_argument("--work", type=Path, help="where the data, scores and kept shards go (default: a temp dir)")
    args = parser.parse_args()
    if args.work is not None:
        main_figures(args.coco_mini, args.work)
    else:
        with tempfile.TemporaryDirectory(prefix="fqr-figures-") as tmp:
            main_figures(args.coco_mini, Path(tmp))
