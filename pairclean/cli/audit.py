"""`pairclean audit` and `pairclean audit-import`: mark a stratified sample by hand, measure on your own data.

`--blind` draws the sample that measures: random pairs within sim strata, in random order, with no
score shown; `evaluate detection --truth` then weights the marks back to the whole dataset."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import typer

import pairclean.cli.options as options
from pairclean.cli.app import app, console

if TYPE_CHECKING:
    from pairclean.scorefile.stratified import JudgeError


@app.command("audit")
@options.dataset_options
def audit_command(
    ctx: typer.Context,
    scores: Path = typer.Argument(..., help="Scores Parquet written by `pairclean score`."),
    shards: Optional[List[str]] = typer.Option(None, "--shards", help="The scored shards (thumbnails and texts come from "
                                               "them; default: the dataset the scores recorded)."),
    out: Path = typer.Option(Path("audit.html"), "--out", "-o", help="The audit page to write."),
    blind: bool = typer.Option(False, "--blind", help="Measure: --pairs pairs drawn at random within --strata sim ranges "
                                                      "of equal size, shown in random order without similarity or "
                                                      "decile; evaluate detection weights the marks back to the whole "
                                                      "dataset, with 95% intervals."),
    pairs: int = typer.Option(200, help="--blind: pairs to draw (spread evenly over the strata)."),
    repeat: float = typer.Option(0.2, help="--blind: share of the drawn pairs shown a second time at another random "
                                           "place, unannounced: the two marks measure the judge, and evaluate "
                                           "detection widens its intervals for the errors they show (0: none)."),
    strata: int = typer.Option(10, help="--blind: sim ranges holding about equally many pairs, drawn from alike."),
    per_decile: int = typer.Option(10, help="Without --blind: pairs drawn from each similarity decile (shown lowest "
                                            "first, with their similarity)."),
    seed: int = typer.Option(0, help="Which pairs are drawn (and, with --blind, their order)."),
    overwrite: bool = typer.Option(False, help="Replace an existing output file."),
    allow_other_dataset: options.AllowOtherDataset = False,
) -> None:
    """A self-contained HTML page where a person marks keep / drop (k / d, arrows) and exports the marks."""
    dataset = options.dataset_given(ctx)
    from pairclean.curate.audit import build_audit

    n = build_audit(scores, shards, out, per_decile=per_decile, seed=seed, fields=dataset.given_fields(),
                    overwrite=overwrite, allow_other_dataset=allow_other_dataset, blind=blind,
                    pairs=pairs, strata=strata, repeat=repeat, **dataset.options())
    drawn = f"drawn at random within {strata} sim strata, in random order, no scores shown" if blind else \
        f"{per_decile} per similarity decile"
    console.print(f"{n:,} pairs ({drawn}) -> {out}; mark them with k / d, export, then `pairclean audit-import "
                  f"marks.json --out truth.parquet` and `pairclean evaluate detection {scores} --truth truth.parquet`",
                  soft_wrap=True)


MARKS_SCHEMA = """marks.json, what the audit page exports. The decile page's: a JSON list of marks,
{"key": str, "shard": str, "index": int >= 0, "mark": "keep" or "drop"} (drop: the pair is
noisy). The blind page's: {"audit": "blind", "design": {...}, "marks": [...]}, whose marks also
carry "stratum" (1.. of the design) and "look" (1, or 2 for the second look at a pair the page
showed twice, unannounced), and whose design is {"version": 1, "seed": int, "scores": the scores
file's name, "scored_pairs": int, "repeated": pairs shown twice, "strata": [{"stratum": 1..,
"sim_above": number or null, "sim_at_most": number or null, "pairs": N_h, "drawn": n_h}]}, each
stratum's sim range starting where the one before ends. A pair left unmarked is left out. Any other
field, type or value is refused in one line naming the entry. The truth Parquet: key, shard,
index, noisy (and for a blind audit stratum and noisy_again, the second look's mark, with the
design in the file's metadata)."""


@app.command("audit-import", epilog=MARKS_SCHEMA)
def audit_import_command(
    marks: Path = typer.Argument(..., help="The JSON the audit page exported."),
    out: Path = typer.Option(..., "--out", "-o", help="Truth Parquet for `evaluate detection --truth`."),
    overwrite: bool = typer.Option(False, help="Replace an existing output file."),
) -> None:
    """Turn the audit page's exported marks into a truth Parquet (noisy = marked drop)."""
    from pairclean.curate.audit import import_marks

    imported = import_marks(marks, out, overwrite=overwrite)
    design, judge = imported.design, imported.judge
    strata = f" (a blind audit: {len(design.strata)} strata of {design.scored_pairs:,} scored pairs, kept with " \
             "the marks)" if design else ""
    console.print(f"{imported.marked:,} marks -> {out}{strata}", soft_wrap=True)
    if design is not None:
        console.print(judge_line(judge, design.repeated), soft_wrap=True)


def judge_line(judge: JudgeError, repeated: int | None) -> str:
    """What the pairs shown twice say of the judge, in one line (audit-import and evaluate)."""
    if not judge.repeated:
        shown = f"{repeated:,} pairs were shown twice but none was marked on both looks" if repeated else \
            "no pair was shown twice"
        return f"judge not measured ({shown}): the intervals take every mark as right"
    value, low, high = judge.interval()
    return (f"judge: {judge.repeated:,} pairs marked on both looks, {judge.disagreed:,} differently "
            f"(agreement {100 * judge.agreement:.1f}%): an error rate of about {100 * value:.1f}% "
            f"[{100 * low:.1f}, {100 * high:.1f}], which the intervals account for")
