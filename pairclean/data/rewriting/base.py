"""Copying a dataset in its own shape: what filter and corrupt ask of the dataset's format.

Filter writes the kept samples (`write_kept`: every member or column as stored) or, on a dry
run, counts their bytes (`kept_bytes`); corrupt copies each shard with some captions replaced
(`rewrite`). Not every way of storing pairs can be copied the same way, so this is its own
protocol beside `data.formats.InputFormat`: a `Rewriter` subclass registers for a format class
(`@rewrites(FormatClass)`, inherited by the format's subclasses) and `rewriter_for(dataset)` finds it.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from pairclean.data.dataset import Dataset
from pairclean.data.formats import InputFormat
from pairclean.errors import UserError


@dataclass
class Decisions:
    """One shard's (or row range's) decisions, positioned by index: `scored[i]`, `keys[i]`,
    `flags[rule][i]` (the last row is keep). Filter computes them; the rewriter writes by them."""

    scored: np.ndarray  # bool, True where the scores have this index
    keys: np.ndarray  # object
    flags: np.ndarray  # bool, (n_rules + 1, size)

    @property
    def keep(self) -> np.ndarray:
        return self.flags[-1]


class KeptRows(Protocol):
    """What filter hands a rewriter (`curate.filter.ScoresKept`): the decisions of a shard's rows (by
    the shard's name in the dataset), and the last scored index of a shard."""

    rules: int

    def decisions(self, shard: str, lo: int | None = None, hi: int | None = None) -> Decisions: ...

    def last_index(self, shard: str) -> int | None: ...


@dataclass
class Written:
    """What a rewriter wrote for filter: the files (the data files, not their sidecars) and the tally."""

    files: list[Path] = field(default_factory=list)
    pairs: int = 0
    bytes: int = 0
    read_failures: list[dict] = field(default_factory=list)


NextCaption = Callable[[str, int, "str | None"], "str | None"]  # (shard, index, key) -> new caption or None
Progress = Callable[[str], None] | None


def changed(shard: str, detail: str) -> UserError:
    """A shard whose rows are not the ones the scores name at their positions (it changed since it
    was scored, or it is another download named alike): never waived, rows would be misattributed."""
    return UserError(f"{shard} changed since it was scored ({detail}); score it again before using these scores")


def check_key(shard: str, dec: Decisions, i: int, key: str) -> None:
    """A kept sample is the one the scores describe: a shard that changed since stops the run."""
    if i >= len(dec.scored):
        return  # past the last scored row: not kept, nothing to compare
    if dec.scored[i] and dec.keys[i] != key:
        raise changed(shard, f"sample {i} is {key!r} in the shard but {dec.keys[i]!r} in the scores")


class Rewriter(ABC):
    """Copies one dataset (`self.dataset`, read through its bound format `self.format`)."""

    def __init__(self, dataset: Dataset):
        self.dataset, self.spec, self.format = dataset, dataset.spec, dataset.input_format

    def check_rewritable(self) -> None:
        """Refuse to copy a dataset whose copy could not be read (images named by relative path)."""

    def copy_root(self) -> str | None:
        """Where a rewritten copy finds the images this dataset names by path (None: it holds its images)."""
        return None

    def output_name(self, shard: str) -> str:
        """The file name a rewritten copy of `shard` gets (corrupt keeps names)."""
        return os.path.basename(shard)

    def bytes_estimated(self) -> bool:
        """Whether `kept_bytes` estimates (compressed pages shared out over rows) rather than counts."""
        return False

    @abstractmethod
    def write_kept(self, kept: KeptRows, tmp: Path, prefix: str, shard_size: int, shard_bytes: float,
                   progress: Progress) -> Written:
        """Filter: the kept samples, every member or column as stored, as new files under `tmp`."""

    @abstractmethod
    def kept_bytes(self, kept: KeptRows, shard: str, failures: list[dict]) -> tuple[int, np.ndarray]:
        """Filter's dry run: (bytes of the scored rows, bytes each rule keeps) of one shard."""

    @abstractmethod
    def rewrite(self, shard: str, tmp: Path, next_caption: NextCaption, caption_field: str) -> None:
        """Corrupt: copy `shard` into `tmp` under `output_name(shard)`, each pair's caption replaced
        by `next_caption(shard, index, key)` when it gives one, everything else as stored."""


REWRITERS: dict[type[InputFormat], type[Rewriter]] = {}


def rewrites(format_class: type[InputFormat]):
    """Register a Rewriter class for a format class (and, unless they register their own, its subclasses)."""
    def register(cls: type[Rewriter]) -> type[Rewriter]:
        REWRITERS[format_class] = cls
        return cls

    return register


def rewriter_for(dataset: Dataset) -> Rewriter:
    """The rewriter of the dataset's format: the one registered for its class or its nearest base."""
    for cls in type(dataset.input_format).__mro__:
        if cls in REWRITERS:
            return REWRITERS[cls](dataset)
    raise UserError(f"pairclean cannot copy {dataset.input_format.label}")
