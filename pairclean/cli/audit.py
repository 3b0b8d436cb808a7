"""`pairclean audit` and `pairclean audit-import`: mark a stratified sample by hand, measure on your own data.

`--blind` draws the sample that measures: random pairs within sim strata, in random order, with no
score shown; `evaluate detection --truth` then weights the marks back to the whole dataset."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

import pairclean.cli.options as options
from pairclean.cli.app import app, console


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
                    pairs=pairs, strata=strata, **dataset.options())
    drawn = f"drawn at random within {strata} sim strata, in random order, no scores shown" if blind else \
        f"{per_decile} per similarity decile"
    console.print(f"{n:,} pairs ({drawn}) -> {out}; mark them with k / d, export, then `pairclean audit-import "
                  f"marks.json --out truth.parquet` and `pairclean evaluate detection {scores} --truth truth.parquet`",
                  soft_wrap=True)


@app.command("audit-import")
def audit_import_command(
    marks: Path = typer.Argument(..., help="The JSON the audit page exported."),
    out: Path = typer.Option(..., "--out", "-o", help="Truth Parquet for `evaluate detection --truth`."),
    overwrite: bool = typer.Option(False, help="Replace an existing output file."),
) -> None:
    """Turn the audit page's exported marks into a truth Parquet (noisy = marked drop)."""
    from pairclean.curate.audit import import_marks

    n, design = import_marks(marks, out, overwrite=overwrite)
    strata = f" (a blind audit: {len(design.strata)} strata of {design.scored_pairs:,} scored pairs, kept with " \
             "the marks)" if design else ""
    console.print(f"{n:,} marks -> {out}{strata}", soft_wrap=True)
