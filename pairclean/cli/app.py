"""The typer application and the consoles every command prints to (stdout: results, stderr: messages)."""

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Find and neutralise mismatched pairs in CLIP-style training data.")
console = Console()
err_console = Console(stderr=True)
