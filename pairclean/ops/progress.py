"""Progress: the one way library code tells how far a long job has come.

Library functions take a `Progress` (default: silent) and never draw anything themselves; the
CLI hands in a rich display (`pairclean.cli.progress.RichProgress`). Two kinds of report:
a counted task (`with progress.task("scoring", total=n) as task: task.update(advance=1, pairs=k)`)
and a one-line step note (`progress.note("wrote shard-000001.tar")`). A note that names settings
marks them as code and lists them, as a warning does (`progress.note("... `beta_k` 256 ...",
"beta_k")`): the CLI words them as its flags.

Every step that can take more than a few seconds reports one or the other from its start: a
person watching a terminal or reading a log is never left without a line for minutes.
"""

from __future__ import annotations

import contextlib
from typing import Iterator


class ProgressTask:
    """A counted task; `fields` are named figures a display may show beside the count."""

    def update(self, advance: int = 0, **fields) -> None:
        """Silent."""


class Progress:
    """Silent progress: what library calls get unless a caller asks for a display."""

    @contextlib.contextmanager
    def task(self, label: str, total: int | None = None, completed: int = 0, **fields) -> Iterator[ProgressTask]:
        yield ProgressTask()

    def note(self, message: str, *fields: str) -> None:
        """Silent. `fields`: the config fields the message names."""


SILENT = Progress()
