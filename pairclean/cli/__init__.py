"""The `pairclean` command line: a thin typer layer over the Python API.

Every user error is one line on stderr and exit code 2; an unexpected error prints one line
and the path of a log file holding the traceback.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
import tempfile
import time
import traceback

import typer
from rich.text import Text

from pairclean.cli.app import app, console, err_console
from pairclean.cli.options import flag_for
from pairclean.cli.terminal import literal
from pairclean.errors import ConfigError, UserError, word_fields

try:  # typer >= 0.22 runs on its own copy of click; older typer on click itself
    from typer import TyperException as _CliError
except ImportError:  # pragma: no cover - depends on the installed typer
    from click import ClickException as _CliError
_CLI_ERRORS = (_CliError,)
_EXITS = (typer.Exit,)  # click's Exit/Abort under older typer, which re-exports them
_ABORTS = (typer.Abort,)
_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EACCES, errno.EPERM, errno.EROFS, errno.EDQUOT, errno.EFBIG}


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
    from pairclean.cli import (  # noqa: F401  # noqa: F401
        audit,
        bench,  # noqa: F401
        dedup,
        evaluate,
        filter,
        lab,
        query,
        report,
        score,
        synth,
        train,  # noqa: F401
    )


def _crash_log(exc: BaseException) -> str:
    directory = os.environ.get("PAIRCLEAN_LOG_DIR") or os.path.join(tempfile.gettempdir(), "pairclean-logs")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"crash-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log")
    with open(path, "w") as fh:
        fh.write(" ".join(sys.argv) + "\n\n")
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=fh)
    return path


def _one_line(kind: str, message: str, colour: str = "red") -> None:
    # The message carries user text (paths, predicates): printed literally, `[/red]` in it is not parsed.
    err_console.print(Text.assemble((f"{kind}:", colour), " ", literal(message)), soft_wrap=True)


class _NoticeLines(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        _one_line("warning", word_fields(record.getMessage(), getattr(record, "fields", ()), flag_for), colour="yellow")


@contextlib.contextmanager
def _notices_as_lines():
    """pairclean's warnings as `warning: ...` lines on stderr while a command runs, and only
    there: not also through a root handler that a dependency's `logging.warning()` installed
    (which printed them a second time as `WARNING:pairclean:...`)."""
    logger = logging.getLogger("pairclean")
    handler, propagate = _NoticeLines(), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def main(argv: list[str] | None = None) -> None:
    # Before torch loads libgomp: idle OpenMP threads sleep instead of spinning, so DataLoader
    # workers decoding on the same cores are not starved (measured in docs/benchmarks.md).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    _register_commands()
    try:
        with _notices_as_lines():
            returned = app(args=argv, standalone_mode=False, prog_name="pairclean")
        if returned == 130:  # typer hands a Ctrl-C inside a command back as this value
            raise KeyboardInterrupt
        if isinstance(returned, int) and returned:
            sys.exit(returned)
    except UserError as exc:
        message = exc.worded(flag_for) if isinstance(exc, ConfigError) else str(exc)
        _one_line("error", message.replace("\n", " "))
        sys.exit(2)
    except _EXITS as exc:
        sys.exit(getattr(exc, "exit_code", 0))
    except _CLI_ERRORS as exc:  # usage errors: unknown option, missing argument, bad value
        if type(exc).__name__ == "NoArgsIsHelpError":
            exc.show()  # the help text, as asked for by running a command without arguments
        else:
            ctx = getattr(exc, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            _one_line("error", exc.format_message().replace("\n", " ") + hint)
        sys.exit(2 if getattr(exc, "exit_code", 1) in (1, 2) else exc.exit_code)
    except (*_ABORTS, KeyboardInterrupt):
        _one_line("interrupted", "re-run the same command to resume")
        sys.exit(130)
    except OSError as exc:
        if exc.errno not in _ENVIRONMENT_ERRNOS:
            _crash(exc)
        # A full disk, a read-only or forbidden path: the user's to fix, but keep the traceback too.
        target = f" {exc.filename}" if exc.filename else ""
        _one_line("error", f"cannot access{target}: {exc.strerror} (traceback in {_crash_log(exc)})")
        sys.exit(2)
    except Exception as exc:  # noqa: BLE001 - the one place that turns crashes into a line + log
        _crash(exc)


def _crash(exc: BaseException) -> None:
    path = _crash_log(exc)
    first = str(exc).splitlines()[0] if str(exc) else ""
    _one_line("unexpected error", f"{type(exc).__name__}: {first} (traceback in {path})")
    sys.exit(1)
