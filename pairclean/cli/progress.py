"""The CLI's progress display: rich bars for the library's `pairclean.ops.progress` reports."""

from __future__ import annotations

import contextlib
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichBars
from rich.text import Text

from pairclean.cli.terminal import literal
from pairclean.ops.progress import Progress, ProgressTask

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


class RichProgress(Progress):
    """A bar per task and a line per note, on the console the command writes to."""

    def __init__(self, console: Console, prefix: str = ""):
        self.console, self.prefix = console, prefix

    @contextlib.contextmanager
    def task(self, label: str, total: int | None = None, completed: int = 0, **fields) -> Iterator[ProgressTask]:
        bars = RichBars(TextColumn("{task.description}", style="bold", markup=False), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[figures]}", markup=False), TimeElapsedColumn(), console=self.console,
                        transient=False)
        with bars:
            task_id = bars.add_task(label, total=total, completed=completed, figures=_figures(fields))
            yield _RichTask(bars, task_id, dict(fields))

    def note(self, message: str) -> None:
        line = Text.assemble((f"{self.prefix} ", "bold"), literal(message)) if self.prefix else literal(message)
        self.console.print(line, highlight=False, soft_wrap=True)
