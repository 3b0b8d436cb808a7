"""The blind audit's 95% intervals against a known truth: do they cover, and how fast do they narrow?

A corrupted toy world with known truth (the demo's: 2,000 pairs, 50% of the captions shuffled,
scored by the demo's trained estimator) is audited again and again: for each of `--samples`
seeds and each sample size in `--pairs`, `pairclean audit --blind` writes the page, a script marks
every pair on it from the truth (drop = truly noisy, as a perfect judge would; as
tests/test_audit.py does), `pairclean audit-import` makes the truth file and `pairclean evaluate
detection` weights the marks back to the 2,000 pairs. Each interval is compared with the true value
over all 2,000 pairs: the noise share, and the GMM rule's (and the beta rule's) precision and recall.
Every step is the CLI, run in this process (`pairclean.cli.main`).

    pairclean demo --out demo-output                      # once: the corrupted world and its scores
    python benchmarks/blind_audit_coverage.py --demo demo-output --samples 20 --pairs 100 400

Prints one table (coverage k / samples, mean interval width in points, and the width at the
largest sample size over the width at the smallest) and writes every interval with `--json`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path

import duckdb

from pairclean.cli import main

FIGURES = (("noise share", None, None), ("GMM precision", "gmm", "precision"), ("GMM recall", "gmm", "recall"),
           ("beta precision", "beta", "precision"), ("beta recall", "beta", "recall"))


def cli(*args) -> str:
    """One pairclean command, as a user runs it; its output (a failure stops the benchmark)."""
    out = StringIO()
    with redirect_stdout(out):
        code = main([str(a) for a in args])
    if code not in (0, None):
        sys.exit(f"pairclean {' '.join(map(str, args))} exited {code}")
    return out.getvalue()


def true_values(scores: Path, truth: Path) -> dict[str, float]:
    """Each figure over every scored pair, from the whole truth."""
    rows = duckdb.sql(f"""SELECT t.noisy, s.gmm_noisy, s.osa_noisy FROM '{scores}' s JOIN '{truth}' t
                          USING (shard, "index") WHERE s.sim IS NOT NULL""").fetchall()
    noisy = [bool(r[0]) for r in rows]
    flags = {"gmm": [bool(r[1]) for r in rows], "beta": [bool(r[2]) for r in rows]}
    values = {"noise share": sum(noisy) / len(noisy)}
    for rule, flagged in flags.items():
        hits = sum(n and f for n, f in zip(noisy, flagged))
        values[f"{'GMM' if rule == 'gmm' else 'beta'} precision"] = hits / sum(flagged)
        values[f"{'GMM' if rule == 'gmm' else 'beta'} recall"] = hits / sum(noisy)
    return values


def marks_from_truth(page: Path, truth: dict, out: Path) -> None:
    """The export a perfect judge would make of the page: every pair marked from the truth."""
    text = page.read_text(encoding="utf-8")
    items = json.loads(re.search(r"const ITEMS = (.*);\nconst STORE", text).group(1))
    design = json.loads(re.search(r"const DESIGN = (.*);  //", text).group(1))
    marks = [{**it, "mark": "drop" if truth[(it["shard"], it["index"])] else "keep"} for it in items]
    out.write_text(json.dumps({"audit": "blind", "design": design, "marks": marks}))


def one_audit(scores: Path, truth: dict, pairs: int, seed: int, work: Path) -> dict:
    page, marks, marked = work / f"audit-{pairs}-{seed}.html", work / "marks.json", work / "audit-truth.parquet"
    cli("audit", scores, "--blind", "--pairs", pairs, "--seed", seed, "--out", page)
    marks_from_truth(page, truth, marks)
    cli("audit-import", marks, "--out", marked, "--overwrite")
    cli("evaluate", "detection", scores, "--truth", marked, "--json", work / "detection.json", "--overwrite")
    audit = json.loads((work / "detection.json").read_text())["audit"]
    page.unlink()
    found = {}
    for name, rule, what in FIGURES:
        estimate = audit["noise_share"] if rule is None else audit["rules"][rule][what]
        found[name] = estimate
    return found


def main_(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", type=Path, default=Path("demo-output"), help="a `pairclean demo` output directory")
    parser.add_argument("--samples", type=int, default=20, help="audits per sample size (seeds 0..samples-1)")
    parser.add_argument("--pairs", type=int, nargs="+", default=[100, 400], help="pairs marked per audit")
    parser.add_argument("--json", type=Path, help="write every interval here")
    args = parser.parse_args(argv)
    scores, truth_file = args.demo / "scores.parquet", args.demo / "noisy" / "truth" / "truth.parquet"
    truth = {(shard, index): bool(noisy) for shard, index, noisy in
             duckdb.sql(f"""SELECT shard, "index", noisy FROM '{truth_file}'""").fetchall()}
    true = true_values(scores, truth_file)
    started = time.perf_counter()
    results: dict[int, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="blind-audit-") as tmp:
        for pairs in args.pairs:
            results[pairs] = [one_audit(scores, truth, pairs, seed, Path(tmp))
                              for seed in range(args.samples)]
    print(f"blind audits of {scores} ({args.samples} seeds each, marks from {truth_file}; "
          f"{time.perf_counter() - started:.0f} s)")
    print(f"| figure | true value % | {' | '.join(f'{p} pairs: covered, mean width (pt)' for p in args.pairs)} | "
          f"width {args.pairs[-1]} / {args.pairs[0]} |")
    print("|---|---|" + "---|" * len(args.pairs) + "---|")
    for name, _, _ in FIGURES:
        cells, widths = [], []
        for pairs in args.pairs:
            found = [r[name] for r in results[pairs] if r[name]["value"] is not None]
            covered = sum(e["low"] <= true[name] <= e["high"] for e in found)
            width = 100 * sum(e["high"] - e["low"] for e in found) / len(found)
            widths.append(width)
            cells.append(f"{covered} / {len(found)}, {width:.1f}")
        print(f"| {name} | {100 * true[name]:.2f} | {' | '.join(cells)} | {widths[-1] / widths[0]:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"true": true, "results": {str(k): v for k, v in results.items()}}, indent=1))


if __name__ == "__main__":
    main_()
