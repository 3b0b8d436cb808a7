"""Units: the resumable, distributable pieces a dataset is read in, and their one string form.

A tar shard is its URL, a Parquet row group is `path#rg=N`, a chunk of rows of an .npy
embedding pair is `left.npy#rows=A-B` (rows A to B-1). The string names the part files and fills
units.json of a scoring run, and its path is what the output's `shard` column holds, so this
module is the only place that writes or reads it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from enum import Enum


_ROW_GROUP = re.compile(r"(?P<path>.*)#rg=(?P<n>\d+)", re.DOTALL)
_ROWS = re.compile(r"(?P<path>.*)#rows=(?P<start>\d+)-(?P<stop>\d+)", re.DOTALL)


class UnitKind(Enum):
    TAR = "tar"  # a whole tar shard
    ROW_GROUP = "row group"  # one row group of a Parquet file
    ROWS = "rows"  # a range of rows of an .npy embedding pair


@dataclass(frozen=True)
class Unit:
    path: str  # the file (or URL) the unit is part of: its rows' `shard`
    kind: UnitKind = UnitKind.TAR
    part: int | range | None = None  # the row group number, or the row range

    @classmethod
    def row_group(cls, path: str, number: int) -> Unit:
        return cls(path, UnitKind.ROW_GROUP, number)

    @classmethod
    def rows(cls, path: str, start: int, stop: int) -> Unit:
        return cls(path, UnitKind.ROWS, range(start, stop))

    @classmethod
    def parse(cls, text: str) -> Unit:
        """The unit a string names; anything without a row-group or rows suffix is a tar shard."""
        if match := _ROW_GROUP.fullmatch(text):
            return cls.row_group(match["path"], int(match["n"]))
        if match := _ROWS.fullmatch(text):
            return cls.rows(match["path"], int(match["start"]), int(match["stop"]))
        return cls(text)

    def __str__(self) -> str:
        if self.kind is UnitKind.ROW_GROUP:
            return f"{self.path}#rg={self.part}"
        if self.kind is UnitKind.ROWS:
            return f"{self.path}#rows={self.part.start}-{self.part.stop}"
        return self.path


def unit_shard(unit: str) -> str:
    """The shard (file) a unit belongs to: what the output's `shard` column holds."""
    return Unit.parse(unit).path


def unique_shards(shards: list[str]) -> list[str]:
    """Each shard once, in first-seen order: `x.tar`, `../shards/x.tar` and a symlink to it are one
    local file (compared by real path), which would otherwise be scored and filtered twice."""
    seen: set[str] = set()
    out = []
    for shard in shards:
        identity = os.path.realpath(shard) if "://" not in shard and not shard.startswith("pipe:") else shard
        if identity not in seen:
            seen.add(identity)
            out.append(shard)
    return out
