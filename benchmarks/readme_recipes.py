"""What README's own filter and training recipes discard, measured against the truth.

Every `--where "..."` (filter) and `--filter "..."` (train) predicate that README.md shows is read
from the README itself, compiled the way `pairclean filter` and `pairclean train` compile it
(`scores.db.compile_predicate`, so a predicate over a rule that abstains on this file prints its
warning here too), and counted against a truth file: the share of the clean pairs it discards and
the share of the noisy pairs it removes. Issue 25 asks that on hard noise (captions of similar
items, where the GMM rule abstains) no recipe silently discards more than 5% of the clean pairs.

    python benchmarks/coco_text_detection.py --settings hard:0.2 --workdir /tmp/coco   # scores + truth
    python benchmarks/readme_recipes.py /tmp/coco/scores-hard-20-s0.parquet /tmp/coco/noisy-hard-20-s0/truth/truth.parquet
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = re.compile(r"pairclean (filter|train) .*?--(where|filter) \"([^\"]+)\"")


def readme_recipes(readme: Path) -> list[tuple[str, str]]:
    """(command, predicate) of every filter / train recipe in the README, in order, once each."""
    found = [(m.group(1), m.group(3)) for m in RECIPE.finditer(readme.read_text())]
    return list(dict.fromkeys(found))


def discarded(scores: Path, truth: Path, recipes: list[tuple[str, str]]) -> list[dict]:
    from pairclean.scorefile.db import ScoresDB, compile_predicate

    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    logger = logging.getLogger("pairclean")
    handler = Collect(level=logging.WARNING)
    logger.addHandler(handler)
    rows = []
    try:
        with ScoresDB(scores, truth=truth) as db:
            for command, predicate in recipes:
                before = len(warnings)
                keep = compile_predicate(db, predicate, "where" if command == "filter" else "filter", view="labeled")
                clean, noisy, clean_dropped, noisy_dropped = db.con.execute(
                    f"SELECT count(*) FILTER (WHERE NOT noisy), count(*) FILTER (WHERE noisy), "
                    f"count(*) FILTER (WHERE NOT noisy AND NOT COALESCE({keep}, FALSE)), "
                    f"count(*) FILTER (WHERE noisy AND NOT COALESCE({keep}, FALSE)) "
                    f"FROM labeled WHERE noisy IS NOT NULL AND sim IS NOT NULL").fetchone()
                rows.append({"command": command, "predicate": predicate, "clean": clean, "noisy": noisy,
                             "clean_discarded": 100.0 * clean_dropped / clean if clean else None,
                             "noise_removed": 100.0 * noisy_dropped / noisy if noisy else None,
                             "warning": warnings[before] if len(warnings) > before else None})
    finally:
        logger.removeHandler(handler)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scores", type=Path)
    parser.add_argument("truth", type=Path, help="truth Parquet (noisy + shard/index), e.g. corrupt's truth/truth.parquet")
    parser.add_argument("--readme", type=Path, default=REPO / "README.md")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = discarded(args.scores, args.truth, readme_recipes(args.readme))
    for r in rows:
        print(f"{r['command']:6s} {r['predicate']!r:40s} clean discarded {r['clean_discarded']:5.1f}% "
              f"(of {r['clean']:,})  noise removed {r['noise_removed']:5.1f}% (of {r['noisy']:,})"
              + (f"\n       warning: {r['warning']}" if r["warning"] else ""))
    if args.json:
        args.json.write_text(json.dumps({"scores": str(args.scores), "readme": str(args.readme), "recipes": rows},
                                        indent=2))


if __name__ == "__main__":
    main()
