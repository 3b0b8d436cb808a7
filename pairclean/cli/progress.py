"""The CLI's progress display for the library's `pairclean.ops.progress` reports: rich bars on a
terminal (count, figures, time elapsed and left), and on anything else (a log, CI, a pipe) a plain
line when a task starts, every LOG_EVERY seconds while it runs, and when it ends: a rich bar
there would print nothing until the task ends."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichBars
from rich.text import Text

from pairclean.cli.options import flag_for
from pairclean.cli.terminal import literal
from pairclean.errors import word_fields
from pairclean.ops.progress import Progress, ProgressTask

LOG_EVERY = 5.0  # seconds between two lines of a task when the output is not a terminal

# How a task's named figures are shown: format and unit, in this order; others are not shown.
_FIGURES = {"pairs": "{:,} pairs", "rate": "{:,.0f} pairs/s", "loss": "loss {:.4f}", "lr": "lr {:.2e}"}


def _figures(fields: dict) -> str:
    return "  ".join(fmt.format(fields[name]) for name, fmt in _FIGURES.items() if fields.get(name) is not None)


class _RichTask(ProgressTask):
    def __init__(self, bars: RichBars, task_id, fields: dict):
        self.bars, self.task_id, self.fields = bars, task_id, fields

    def update(self, advance: int = 0, **fields) -> None:
        self.fields.update(fields)
        self.bars.update(self.task_id, advance=advance, figures=_figures(self.fields))


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class _LogTask(ProgressTask):
    """A task as plain lines: at its start, at most every LOG_EVERY seconds, and at its end."""

    def __init__(self, say, label: str, total: int | None, completed: int, fields: dict):
        self.say, self.label, self.total, self.fields = say, label, total, fields
        self.done = self.start_done = completed
        self.started = self.last = time.monotonic()
        self.shown = None  # the count and figures of the last line
        self.line()

    def line(self) -> None:
        """A line with the count, the figures, the time taken and the time left (none when
        nothing changed since the last one)."""
        if self.shown == (self.done, self.fields):
            return
        self.shown = (self.done, dict(self.fields))
        elapsed = time.monotonic() - self.started
        count = f"{self.done:,}/{self.total:,}" if self.total is not None else f"{self.done:,}"
        parts = [f"{self.label}: {count}", _figures(self.fields), _clock(elapsed)]
        rate = (self.done - self.start_done) / elapsed if elapsed > 0 else 0.0
        if self.total is not None and self.done < self.total and rate > 0:
            parts.append(f"about {_clock((self.total - self.done) / rate)} left")
        self.say("  ".join(part for part in parts if part))
        self.last = time.monotonic()

    def update(self, advance: int = 0, **fields) -> None:
        self.done += advance
        self.fields.update(fields)
        if time.monotonic() - self.last >= LOG_EVERY:
            self.line()


class RichProgress(Progress):
    """A bar per task and a line per note, on the console the command writes to (plain lines
    when it is not a terminal: see the module docstring)."""

    def __init__(self, console: Console, prefix: str = ""):
        self.console, self.prefix = console, prefix

    @contextlib.contextmanager
    def task(self, label: str, total: int | None = None, completed: int = 0, **fields) -> Iterator[ProgressTask]:
        if not self.console.is_terminal:
            logged = _LogTask(self._line, label, total, completed, dict(fields))
            yield logged
            logged.line()
            return
        bars = RichBars(TextColumn("{task.description}", style="bold", markup=False), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[figures]}", markup=False), TimeElapsedColumn(),
                        TimeRemainingColumn(), console=self.console, transient=False)
        with bars:
            task_id = bars.add_task(label, total=total, completed=completed, figures=_figures(fields))
            yield _RichTask(bars, task_id, dict(fields))

    def note(self, message: str, *fields: str) -> None:
        self._line(word_fields(message, fields, flag_for))

    def _line(self, message: str) -> None:
        line = Text.assemble((f"{self.prefix} ", "bold"), literal(message)) if self.prefix else literal(message)
        self.console.print(line, highlight=False, soft_wrap=True)
