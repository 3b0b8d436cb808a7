"""The `pairclean` command line: a thin typer layer over the Python API.

Every user error is one line on stderr and exit code 2; an unexpected error prints one line
and the path of a log file holding the traceback.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback

import click
import typer
from rich.console import Console

from pairclean.errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Find and neutralise mismatched pairs in CLIP-style training data.")
console = Console()
err_console = Console(stderr=True)


def _version(value: bool) -> None:
    if value:
        from pairclean import __version__

        console.print(f"pairclean {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Find and neutralise mismatched pairs in CLIP-style training data."""


def _register_commands() -> None:
    # Each module adds its commands to `app`; imported here so `app` is complete.
    from pairclean.cli import evaluate, filter, query, score  # noqa: F401
    from pairclean.cli import train  # noqa: F401


def _crash_log(exc: BaseException) -> str:
    directory = os.environ.get("PAIRCLEAN_LOG_DIR") or os.path.join(tempfile.gettempdir(), "pairclean-logs")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"crash-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log")
    with open(path, "w") as fh:
        fh.write(" ".join(sys.argv) + "\n\n")
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=fh)
    return path


def main(argv: list[str] | None = None) -> None:
    _register_commands()
    try:
        app(args=argv, standalone_mode=False)
    except UserError as exc:
        err_console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(2)
    except (click.exceptions.Abort, KeyboardInterrupt):
        err_console.print("interrupted: re-run the same command to resume", highlight=False)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - the one place that turns crashes into a line + log
        path = _crash_log(exc)
        first = str(exc).splitlines()[0] if str(exc) else ""
        err_console.print(f"[red]unexpected error:[/red] {type(exc).__name__}: {first} (traceback in {path})",
                          highlight=False, soft_wrap=True)
        sys.exit(1)
