"""`pairclean evaluate ...`: detection (scores vs ground truth) and retrieval (a trained model)."""

from __future__ import annotations

from pathlib import Path

import typer

from pairclean.cli import app

evaluate_app = typer.Typer(no_args_is_help=True, help="Measure detection quality or retrieval quality.")
app.add_typer(evaluate_app, name="evaluate")


@evaluate_app.command("retrieval")
def retrieval_command(
    data: list[str] = typer.Argument(..., help="Validation pairs: shards, Parquet files, or a manifest YAML."),
    model: str = typer.Option(..., "--model", help="A `pairclean train` run directory or model file, a sentence-transformers "
                                                   "directory, or (with --arch) an open_clip checkpoint or tag."),
    arch: str | None = typer.Option(None, help="open_clip model name for a bare checkpoint or pretrained tag."),
    pair: str | None = typer.Option(None, help="Pair kind: image-text, text-text, image-label, image-image."),
    batch_size: int = typer.Option(256, help="Pairs per forward pass."),
    workers: int = typer.Option(2, help="DataLoader workers."),
    device: str = typer.Option("auto", help="auto, cpu, cuda ..."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the metrics to this JSON file."),
) -> None:
    """R@1/5/10 both ways and rSum; an image with several captions is one query (hit if any caption is found)."""
    from rich.table import Table

    from pairclean.atomic import write_json
    from pairclean.cli import console
    from pairclean.retrieval import METRIC_NAMES, evaluate_retrieval

    metrics = evaluate_retrieval(model, data, arch=arch, pair=pair, batch_size=batch_size, workers=workers, device=device)
    table = Table(title=f"retrieval: {model}")
    for name in METRIC_NAMES:
        table.add_column(name.replace("_r", " R@"), justify="right")
    table.add_row(*(f"{metrics[name]:.2f}" for name in METRIC_NAMES))
    console.print(table)
    console.print(f"{metrics['queries_i2t']:,} left items (i2t queries), {metrics['queries_t2i']:,} pairs (t2i queries)"
                  + (f", {metrics['skipped']:,} unreadable pairs skipped" if metrics["skipped"] else ""))
    if json_out is not None:
        write_json(json_out, metrics)
