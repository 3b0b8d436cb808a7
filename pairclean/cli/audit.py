"""`pairclean audit` and `pairclean audit-import`: mark a stratified sample by hand, measure on your own data."""

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
    per_decile: int = typer.Option(10, help="Pairs drawn from each similarity decile."),
    seed: int = typer.Option(0, help="Which pairs are drawn."),
    overwrite: bool = typer.Option(False, help="Replace an existing output file."),
    allow_other_dataset: options.AllowOtherDataset = False,
) -> None:
    """A self-contained HTML page where a person marks keep / drop (k / d, arrows) and exports the marks."""
    dataset = options.dataset_given(ctx)
    from pairclean.curate.audit import build_audit

    n = build_audit(scores, shards, out, per_decile=per_decile, seed=seed, fields=dataset.given_fields(),
                    overwrite=overwrite, allow_other_dataset=allow_other_dataset, **dataset.options())
    console.print(f"{n:,} pairs ({per_decile} per similarity decile) -> {out}; mark them with k / d, export, then "
                  "`pairclean audit-import marks.json --out truth.parquet`", soft_wrap=True)


@app.command("audit-import")
def audit_import_command(
    marks: Path = typer.Argument(..., help="The JSON the audit page exported."),
    out: Path = typer.Option(..., "--out", "-o", help="Truth Parquet for `evaluate detection --truth`."),
    overwrite: bool = typer.Option(False, help="Replace an existing output file."),
) -> None:
    """Turn the audit page's exported marks into a truth Parquet (noisy = marked drop)."""
    from pairclean.curate.audit import import_marks

    n = import_marks(marks, out, overwrite=overwrite)
    console.print(f"{n:,} marks -> {out}", soft_wrap=True)
