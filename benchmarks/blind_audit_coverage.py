"""The blind audit's 95% intervals against a known truth: do they cover, for a perfect judge and for
one who errs, and how fast do they narrow?

A corrupted toy world with known truth (the demo's: 2,000 pairs, 50% of the captions shuffled,
scored by the demo's trained estimator) is audited again and again: for each of `--samples`
seeds and each sample size in `--pairs`, `pairclean audit --blind` writes the page (a `--repeat`
share of its pairs shown twice, unannounced), a script marks every item on it from the truth as
each judge of `--flip` would (drop = truly noisy, each item, second looks included, flipped
independently with that probability: 0 is a perfect judge), `pairclean audit-import` makes the
truth file and `pairclean evaluate detection` weights the marks back to the 2,000 pairs. Each
interval is compared with the true value over all 2,000 pairs: the noise share, and the GMM
rule's (and the beta rule's) precision and recall. Every step is the CLI, run in this process
(`pairclean.cli.main`). One more audit per size leaves a stratum unmarked, to show what evaluate
says of it.

    pairclean demo --out demo-output                      # once: the corrupted world and its scores
    python benchmarks/blind_audit_coverage.py --demo demo-output --samples 20 --pairs 100 400 --flip 0 0.05

Prints one table per judge (coverage k / samples, mean interval width in points, intervals of
zero width, the largest effective n) and writes every interval with `--json`. `--replicates N`
adds a second table: the same design drawn N times in this process from the scores and the truth
(the audit's strata, `scores/stratified.audit_figures` on the drawn marks; no page), for the
coverage rate itself.
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

from pairclean.cli import main
from pairclean.scorefile.stratified import audit_figures

FIGURES = (("noise share", None, None), ("GMM precision", "gmm", "precision"), ("GMM recall", "gmm", "recall"),
           ("beta precision", "beta", "precision"), ("beta recall", "beta", "recall"))
RULES = {"gmm": "gmm_noisy", "beta": "osa_noisy"}


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
        values[f"{'GMM' if rule == 'gmm' else 'beta'} precision"] = hits / sum(flagged) if sum(flagged) else float("nan")
        values[f"{'GMM' if rule == 'gmm' else 'beta'} recall"] = hits / sum(noisy)
    return values


def page_items(page: Path) -> tuple[list[dict], dict]:
    text = page.read_text(encoding="utf-8")
    return (json.loads(re.search(r"const ITEMS = (.*);\nconst STORE", text).group(1)),
            json.loads(re.search(r"const DESIGN = (.*);  //", text).group(1)))


def marks_from_truth(page: Path, truth: dict, out: Path, flip: float, rng: np.random.Generator,
                     skip_stratum: int | None = None) -> None:
    """The export a judge makes of the page: every item (second looks included) marked from the
    truth, each flipped with probability `flip` on its own; `skip_stratum` left unmarked."""
    items, design = page_items(page)
    marks = []
    for it in items:
        if it["stratum"] == skip_stratum:
            continue
        noisy = truth[(it["shard"], it["index"])] != (rng.random() < flip)
        marks.append({**it, "mark": "drop" if noisy else "keep"})
    out.write_text(json.dumps({"audit": "blind", "design": design, "marks": marks}))


def evaluated(scores: Path, marks: Path, work: Path) -> tuple[dict, str]:
    marked = work / "audit-truth.parquet"
    cli("audit-import", marks, "--out", marked, "--overwrite")
    out = cli("evaluate", "detection", scores, "--truth", marked, "--json", work / "detection.json", "--overwrite")
    return json.loads((work / "detection.json").read_text())["audit"], out


def one_audit(scores: Path, truth: dict, pairs: int, seed: int, flips: list[float], repeat: float,
              work: Path) -> dict[float, dict]:
    """One page, marked by each judge: {flip: {figure: estimate}} (and the judge's measure)."""
    page = work / f"audit-{pairs}-{seed}.html"
    cli("audit", scores, "--blind", "--pairs", pairs, "--seed", seed, "--repeat", repeat, "--out", page)
    found = {}
    for flip in flips:
        marks = work / "marks.json"
        marks_from_truth(page, truth, marks, flip, np.random.default_rng([seed, pairs, int(flip * 1e6)]))
        audit, _ = evaluated(scores, marks, work)
        found[flip] = {name: audit["noise_share"] if rule is None else audit["rules"][rule][what]
                       for name, rule, what in FIGURES}
        found[flip]["judge"] = audit["judge"]
    page.unlink()
    return found


def unmarked_stratum(scores: Path, truth: dict, pairs: int, work: Path) -> str:
    """What evaluate prints when the judge leaves stratum 2 unmarked."""
    page = work / "unmarked.html"
    cli("audit", scores, "--blind", "--pairs", pairs, "--out", page, "--overwrite")
    marks_from_truth(page, truth, work / "marks.json", 0.0, np.random.default_rng(0), skip_stratum=2)
    audit, out = evaluated(scores, work / "marks.json", work)
    title = next(line for line in out.splitlines() if line.startswith("blind audit:"))
    return f"{title} (unmarked_strata in the JSON: {audit['unmarked_strata']})"


def simulate(scores: Path, truth_file: Path, pairs: int, replicates: int, flip: float, repeat: float,
             strata: int = 10, seed: int = 0) -> dict:
    """Coverage of the audit's intervals over `replicates` stratified samples of `pairs` pairs,
    drawn as the audit draws them (sim strata cut at quantile_disc), a `repeat` share shown twice,
    every mark flipped with probability `flip`."""
    rows = duckdb.sql(f"""SELECT s.sim, t.noisy, s.gmm_noisy, s.osa_noisy FROM '{scores}' s JOIN '{truth_file}' t
                          USING (shard, "index") WHERE s.sim IS NOT NULL ORDER BY s.shard, s."index" """).fetchnumpy()
    sim = rows["sim"].astype(np.float64)
    noisy = rows["noisy"].astype(bool)
    flags = {rule: np.nan_to_num(rows[column].astype(float)).astype(bool) for rule, column in RULES.items()}
    cuts = sorted(set(np.quantile(rows["sim"], np.arange(1, strata) / strata, method="inverted_cdf").tolist()))
    stratum = np.searchsorted(np.asarray(cuts), sim, side="left") + 1
    population = {int(h): int((stratum == h).sum()) for h in np.unique(stratum)}
    flagged = {rule: {h: int((f & (stratum == h)).sum()) for h in population} for rule, f in flags.items()}
    members = {h: np.flatnonzero(stratum == h) for h in population}
    per = {h: pairs // len(population) + (i < pairs % len(population)) for i, h in enumerate(sorted(population))}
    true = true_values(scores, truth_file)
    found = {name: {"covered": 0, "width": 0.0, "zero": 0, "n": 0} for name, _, _ in FIGURES}
    rng = np.random.default_rng(seed)
    for _ in range(replicates):
        drawn = np.concatenate([rng.choice(members[h], per[h], replace=False) for h in sorted(population)])
        seen = noisy[drawn] ^ (rng.random(len(drawn)) < flip)
        again: list[bool | None] = [None] * len(drawn)
        for i in rng.choice(len(drawn), round(repeat * len(drawn)), replace=False):
            again[i] = bool(noisy[drawn[i]] ^ (rng.random() < flip))
        figures = audit_figures(stratum[drawn], seen, again, {r: f[drawn] for r, f in flags.items()}, population,
                                flagged)
        for name, rule, what in FIGURES:
            e = figures.noise_share if rule is None else figures.rules[rule][what]
            if e.value is None:
                continue
            c = found[name]
            c["n"] += 1
            c["covered"] += e.low <= true[name] <= e.high
            c["width"] += e.high - e.low
            c["zero"] += e.high == e.low
    return found


def main_(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", type=Path, default=Path("demo-output"), help="a `pairclean demo` output directory")
    parser.add_argument("--samples", type=int, default=20, help="audits per sample size (seeds 0..samples-1)")
    parser.add_argument("--pairs", type=int, nargs="+", default=[100, 400], help="pairs marked per audit")
    parser.add_argument("--flip", type=float, nargs="+", default=[0.0, 0.05],
                        help="judges: the probability each item's mark is flipped (0: a perfect judge)")
    parser.add_argument("--repeat", type=float, default=0.2, help="share of the pairs the page shows twice")
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
            results[pairs] = [one_audit(scores, truth, pairs, seed, args.flip, args.repeat, Path(tmp))
                              for seed in range(args.samples)]
        unmarked = unmarked_stratum(scores, truth, args.pairs[0], Path(tmp))
    print(f"blind audits of {scores} ({args.samples} seeds each, {100 * args.repeat:g}% of the pairs shown twice, "
          f"marks from {truth_file}; {time.perf_counter() - started:.0f} s)")
    for flip in args.flip:
        judge = "a perfect judge" if flip == 0 else f"a judge who flips {100 * flip:g}% of the marks"
        print(f"\n{judge}:")
        print(f"| figure | true value % | {' | '.join(f'{p} pairs: covered, mean width (pt), zero width, max n_eff' for p in args.pairs)} |")
        print("|---|---|" + "---|" * len(args.pairs))
        for name, _, _ in FIGURES:
            cells = []
            for pairs in args.pairs:
                found = [r[flip][name] for r in results[pairs] if r[flip][name]["value"] is not None]
                covered = sum(e["low"] <= true[name] <= e["high"] for e in found)
                width = 100 * sum(e["high"] - e["low"] for e in found) / max(len(found), 1)
                zero = sum(e["high"] == e["low"] for e in found)
                most = max((e["effective_n"] for e in found), default=float("nan"))
                cells.append(f"{covered} / {len(found)}, {width:.1f}, {zero}, {most:,.0f}")
            print(f"| {name} | {100 * true[name]:.2f} | {' | '.join(cells)} |")
        for pairs in args.pairs:
            judges = [r[flip]["judge"] for r in results[pairs]]
            rates = [j["error_rate"]["value"] for j in judges if j["error_rate"]]
            print(f"{pairs} pairs: the judge's error rate measured {100 * np.mean(rates):.1f}% on average "
                  f"({min(j['repeated'] for j in judges)}-{max(j['repeated'] for j in judges)} pairs marked twice)")
    print(f"\na stratum left unmarked ({args.pairs[0]} pairs, stratum 2 not marked): {unmarked}")
    simulated = {}
    if args.replicates:
        print(f"\nthe same design drawn {args.replicates:,} times per size and judge in-process (seed 0): coverage of "
              "the 95% intervals, mean width (pt), intervals of zero width")
        print(f"| figure | judge | {' | '.join(f'{p} pairs' for p in args.pairs)} |")
        print("|---|---|" + "---|" * len(args.pairs))
        simulated = {(p, flip): simulate(scores, truth_file, p, args.replicates, flip, args.repeat)
                     for p in args.pairs for flip in args.flip}
        for name, _, _ in FIGURES:
            for flip in args.flip:
                cells = [simulated[(p, flip)][name] for p in args.pairs]
                print(f"| {name} | flips {100 * flip:g}% | " + " | ".join(
                    f"{c['covered'] / c['n']:.3f}, {100 * c['width'] / c['n']:.1f}, {c['zero']}" for c in cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"true": true, "results": {str(k): v for k, v in results.items()},
                                         "simulated": {f"{p}-{f}": v for (p, f), v in simulated.items()}},
                                        indent=1, default=float))


if __name__ == "__main__":
    main_()
