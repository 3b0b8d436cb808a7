"""`pairclean evaluate ...`: detection (scores vs ground truth) and retrieval (a trained model)."""

from __future__ import annotations

import typer

from pairclean.cli import app

evaluate_app = typer.Typer(no_args_is_help=True, help="Measure detection quality or retrieval quality.")
app.add_typer(evaluate_app, name="evaluate")
