"""`pairclean report`."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

import pairclean.cli.options as options
from pairclean.cli.app import app, console
from pairclean.cli.options import flag_for
from pairclean.errors import word_fields


@app.command("report")
@options.dataset_options
def report_command(
    ctx: typer.Context,
    scores: Path = typer.Argument(..., help="Scores Parquet written by `pairclean score`."),
    out: Path = typer.Option(..., "--out", "-o", help="HTML file to write (self-contained)."),
    shards: Optional[List[str]] = typer.Option(None, "--shards", help="The scored shards or their manifest, for thumbnails (default: the dataset the scores recorded)."),
    truth: Optional[Path] = typer.Option(None, help="Ground-truth Parquet (key, shard, index, noisy): splits the histogram into clean / noisy."),
    gallery: int = typer.Option(24, help="Lowest-scoring pairs shown."),
    contrast: int = typer.Option(8, help="Highest-scoring pairs shown, for contrast."),
    thumb: int = typer.Option(224, help="Thumbnail size in pixels (longest side)."),
    bins: int = typer.Option(60, help="Histogram bins."),
    title: Optional[str] = typer.Option(None, help="Page title (default: the scores file name)."),
    overwrite: bool = typer.Option(False, help="Replace an existing output file."),
    allow_other_dataset: options.AllowOtherDataset = False,
) -> None:
    """One self-contained HTML report: histogram with beta and GMM boundaries, per-shard statistics, gallery."""
    dataset = options.dataset_given(ctx)
    from pairclean.curate.report import build_report

    result = build_report(scores, out, shards=shards, truth=truth, gallery=gallery, contrast=contrast,
                          thumb=thumb, bins=bins, title=title, fields=dataset.given_fields(), overwrite=overwrite,
                          allow_other_dataset=allow_other_dataset, **dataset.options())
    size = out.stat().st_size
    console.print(f"wrote {result.out} ({size / 1e6:.1f} MB): {result.pairs:,} pairs, "
                  f"{result.gallery_pairs} in the galleries, {result.thumbnails} thumbnails", highlight=False)
    if result.media_note:  # it names the library's field `shards`: worded as this command's flag
        console.print(word_fields(result.media_note, ("shards",), flag_for), style="yellow")
