"""The typer application and the consoles every command prints to (stdout: results, stderr: messages)."""

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Find and neutralise mismatched pairs in CLIP-style training data.")
console = Console()
err_console = Console(stderr=True)


def announce(spec) -> None:
    """The one line a run over a dataset starts with: its format and how it is read (its input
    format's `describe`); under torchrun only rank 0 says it."""
    import os

    if os.environ.get("RANK", "0") == "0":
        console.print(spec.input_format.describe(), highlight=False, soft_wrap=True, markup=False)
