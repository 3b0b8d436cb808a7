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
`--replicates N` adds a second table: the same design drawn N times in this process from the
scores and the truth (the audit's strata, `scores/stratified.ratio_estimate` on the drawn pairs; no
page), for the coverage rate itself, beside the normal-approximation interval R +- 1.96 sqrt(v)
that Wilson's replaces.
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
import numpy as np
from scipy.stats import norm

from pairclean.cli import main
from pairclean.scores.stratified import ratio_estimate

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


def simulate(scores: Path, truth_file: Path, pairs: int, replicates: int, strata: int = 10, seed: int = 0) -> dict:
    """Coverage of the Wilson and the normal-approximation intervals over `replicates` stratified
    samples of `pairs` pairs, drawn as the audit draws them (sim strata cut at quantile_disc)."""
    rows = duckdb.sql(f"""SELECT s.sim, t.noisy, s.gmm_noisy, s.osa_noisy FROM '{scores}' s JOIN '{truth_file}' t
                          USING (shard, "index") WHERE s.sim IS NOT NULL ORDER BY s.shard, s."index" """).fetchnumpy()
    sim = rows["sim"].astype(np.float64)
    noisy, flags = rows["noisy"].astype(bool), {"GMM": rows["gmm_noisy"].astype(bool), "beta": rows["osa_noisy"].astype(bool)}
    cuts = sorted(set(np.quantile(rows["sim"], np.arange(1, strata) / strata, method="inverted_cdf").tolist()))
    stratum = np.searchsorted(np.asarray(cuts), sim, side="left") + 1
    population = {int(h): int((stratum == h).sum()) for h in np.unique(stratum)}
    members = {h: np.flatnonzero(stratum == h) for h in population}
    per = {h: pairs // len(population) + (i < pairs % len(population)) for i, h in enumerate(sorted(population))}
    figures = {"noise share": (noisy, np.ones_like(noisy))}
    for rule, f in flags.items():
        figures[f"{rule} precision"] = (noisy & f, f)
        figures[f"{rule} recall"] = (noisy & f, noisy)
    true = {name: y.sum() / x.sum() for name, (y, x) in figures.items()}
    z = float(norm.ppf(0.975))
    found = {name: {"wilson": 0, "normal": 0, "width": 0.0, "n": 0} for name in figures}
    rng = np.random.default_rng(seed)
    for _ in range(replicates):
        drawn = np.concatenate([rng.choice(members[h], per[h], replace=False) for h in sorted(population)])
        for name, (y, x) in figures.items():
            e = ratio_estimate(y[drawn], x[drawn], stratum[drawn], population)
            if e.value is None:
                continue
            c = found[name]
            c["n"] += 1
            c["wilson"] += e.low <= true[name] <= e.high
            c["width"] += e.high - e.low
            half = z * np.sqrt(e.value * (1 - e.value) / e.effective_n)
            c["normal"] += e.value - half <= true[name] <= e.value + half
    return {"true": true, "found": found}


def main_(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", type=Path, default=Path("demo-output"), help="a `pairclean demo` output directory")
    parser.add_argument("--samples", type=int, default=20, help="audits per sample size (seeds 0..samples-1)")
    parser.add_argument("--pairs", type=int, nargs="+", default=[100, 400], help="pairs marked per audit")
    parser.add_argument("--replicates", type=int, default=0, help="also simulate this many audits per size in-process")
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
    simulated = {}
    if args.replicates:
        print(f"\nthe same design drawn {args.replicates:,} times per size in-process (seed 0): coverage of the 95% "
              "intervals, Wilson at Kish's n_eff (as evaluate prints) and the normal approximation")
        print(f"| figure | {' | '.join(f'{p} pairs: Wilson, normal, mean width (pt)' for p in args.pairs)} |")
        print("|---|" + "---|" * len(args.pairs))
        simulated = {p: simulate(scores, truth_file, p, args.replicates) for p in args.pairs}
        for name, _, _ in FIGURES:
            cells = []
            for pairs in args.pairs:
                c = simulated[pairs]["found"][name]
                cells.append(f"{c['wilson'] / c['n']:.3f}, {c['normal'] / c['n']:.3f}, {100 * c['width'] / c['n']:.1f}")
            print(f"| {name} | {' | '.join(cells)} |")
    if args.json:
        args.json.write_text(json.dumps({"true": true, "results": {str(k): v for k, v in results.items()},
                                         "simulated": {str(k): v for k, v in simulated.items()}}, indent=1,
                                        default=float))


if __name__ == "__main__":
    main_()
