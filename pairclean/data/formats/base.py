"""What an input format is, and the registry that finds one for a list of files.

A format is one class: how it recognises its files (`claim`), the field mapping it reads by
default, how it cuts a dataset into units, reads a unit into pairs, counts and keys rows, lists a
directory, rewrites the samples it keeps (filter) or the captions it changes (corrupt), and the
one line that says how a run reads it (`describe`). An instance is bound to a `DatasetSpec`
(`spec.input_format`); classes register by name with `@register_format`, and detection asks each
class in `priority` order whether the files are its layout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable, ClassVar, Iterator, Protocol

import numpy as np

from pairclean.config import check_choice
from pairclean.errors import ConfigError, UserError

if TYPE_CHECKING:
    from pairclean.data.manifest import DatasetSpec
    from pairclean.data.reader import RawPair, UnitFailure

REGISTRY: dict[str, type["InputFormat"]] = {}
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".parquet")  # what a directory listing offers detection


def register_format(cls: type["InputFormat"]) -> type["InputFormat"]:
    """Add a format class to the registry under its `name`."""
    REGISTRY[cls.name] = cls
    return cls


def format_named(name: str, field: str = "input_format", kind: str | None = None) -> type["InputFormat"]:
    """The registered format class of that name (a ConfigError naming `field` otherwise)."""
    check_choice(name, [n for n, c in REGISTRY.items() if kind is None or c.kind == kind], field, "input format")
    return REGISTRY[name]


def format_names(kind: str) -> list[str]:
    return [name for name, cls in REGISTRY.items() if cls.kind == kind]


@dataclass
class Claim:
    """What detection found: the format, the files it reads as shards, the fields it read off them,
    and why the files are that layout (the run's announcement says it)."""

    format: str
    shards: list[str]
    fields: dict[str, str | None] = field(default_factory=dict)
    why: str = ""


def by_priority(kind: str) -> list[type["InputFormat"]]:
    return sorted((c for c in REGISTRY.values() if c.kind == kind), key=lambda c: c.priority)


def directory_files(directory: Path) -> list[str]:
    """The files a directory offers as a dataset: a format's own listing rule (a Hugging Face hub
    folder keeps its files under data/), else its shard files."""
    for cls in by_priority("pairs"):
        found = cls.directory_files(directory)
        if found is not None:
            return found
    return sorted(str(p) for p in directory.iterdir() if p.name.endswith(SHARD_SUFFIXES) and p.is_file())


def detect(files: list[str], format: str | None = None, split: str | None = None) -> Claim:
    """The format of these files (`format` forces one: it then takes the files it can read), the
    shards it reads (of `split` only, when given), and the fields it found."""
    if format is not None:
        cls = format_named(format, "input_format", kind="pairs")
        claim = cls.claim(files, forced=True) or Claim(cls.name, [])  # none of the files is of its kind
        claim.why = f"{format} was named as the input format"
    else:
        claim = next((c for c in (cls.claim(files) for cls in by_priority("pairs")) if c is not None), None)
        if claim is None:
            suffixes = sorted({Path(f).suffix or f for f in files})
            raise UserError(f"cannot tell the format of {len(files)} input file(s) ({', '.join(suffixes)}): give "
                            "tar shards or Parquet files (not both, unless they are img2dataset output), "
                            "or name one with `input_format`")
        cls = REGISTRY[claim.format]
    if not claim.shards:
        raise UserError(f"no {cls.label} files among {', '.join(files[:3])}" + (" ..." if len(files) > 3 else ""))
    if split is not None:
        claim.shards = cls.select_split(claim.shards, split)
    return claim


@dataclass
class Decisions:
    """One shard's (or row range's) decisions, positioned by index: `scored[i]`, `keys[i]`,
    `flags[rule][i]` (the last row is keep). Filter computes them; the format writes by them."""

    scored: np.ndarray  # bool, True where the scores have this index
    keys: np.ndarray  # object
    flags: np.ndarray  # bool, (n_rules + 1, size)

    @property
    def keep(self) -> np.ndarray:
        return self.flags[-1]


class KeptRows(Protocol):
    """What filter hands a format (`curate.filter.ScoresKept`): the decisions of a shard's rows (by
    the shard's name in the dataset), and the last scored index of a shard."""

    rules: int

    def decisions(self, shard: str, lo: int | None = None, hi: int | None = None) -> Decisions: ...

    def last_index(self, shard: str) -> int | None: ...


@dataclass
class Written:
    """What a format wrote for filter: the files (the data files, not their sidecars) and the tally."""

    files: list[Path] = field(default_factory=list)
    pairs: int = 0
    bytes: int = 0
    read_failures: list[dict] = field(default_factory=list)


NextCaption = Callable[[str, int, "str | None"], "str | None"]  # (shard, index, key) -> new caption or None


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


class InputFormat(ABC):
    """One way pairs are stored. Subclasses set the class attributes and the methods their
    layout needs; an instance reads one dataset (`self.spec`)."""

    name: ClassVar[str]
    label: ClassVar[str]  # how the announcement names it: "img2dataset webdataset output"
    kind: ClassVar[str] = "pairs"  # or "embeddings" (scoring from precomputed vectors)
    priority: ClassVar[int] = 100  # detection asks lower numbers first: a specific layout before a generic one
    suffix: ClassVar[str] = ""  # the data files' suffix
    field_defaults: ClassVar[dict[str, str | None]] = {}

    def __init__(self, spec: "DatasetSpec"):
        self.spec = spec

    # -- detection ---------------------------------------------------------------------------

    @classmethod
    def claim(cls, files: list[str], forced: bool = False) -> Claim | None:
        """The files' layout is this format: which of them are shards, which fields were found.
        `forced`: the user named this format; take the files it can read."""
        return None

    @classmethod
    def directory_files(cls, directory: Path) -> list[str] | None:
        """A directory listed this format's own way (None: the common listing)."""
        return None

    @classmethod
    def select_split(cls, shards: list[str], split: str) -> list[str]:
        raise ConfigError(f"`split` {split!r} picks a split of a Hugging Face datasets layout; "
                          f"{cls.label} has none", "split")

    # -- reading -----------------------------------------------------------------------------

    @abstractmethod
    def units(self) -> list[str]:
        """Every unit of the dataset, in a stable order (the order of the output rows)."""

    @abstractmethod
    def read(self, unit: str) -> Iterator["RawPair | UnitFailure"]:
        """The unit's pairs in order (index = position in its shard), then any UnitFailure."""

    def count(self, unit: str) -> int:
        """How many rows the unit holds, from headers or metadata."""
        raise NotImplementedError

    def rows(self, shard: str) -> tuple[int, str | None]:
        """(pairs in the shard that a writer can copy, why the listing stopped early)."""
        raise NotImplementedError

    def keys(self, shard: str) -> list[str]:
        """The keys of the shard's rows by index."""
        raise NotImplementedError

    def metadata_files(self) -> list[str]:
        """Per-shard metadata tables beside the data (img2dataset's sidecars): what `metadata` attaches."""
        return []

    def describe(self) -> str:
        """The one line a run starts with: what is read, and how."""
        f = self.spec.fields
        roles = {"image-text": ("image", "text"), "text-text": ("text", "text2"), "image-label": ("image", "label"),
                 "image-image": ("image", "image2")}[self.spec.pair]
        parts = []
        for role in roles:
            by_path = getattr(f, f"{role}_path") if role in ("image", "image2") else None
            parts.append(f"{role}={by_path} (paths)" if by_path else f"{role}={getattr(f, role)}")
        if self.spec.pair == "image-text" and f.json_text_key and self.suffix == ".tar":
            parts[-1] += f" (else json {f.json_text_key})"
        parts.append(f"key={self.describe_key()}")
        files = len(dict.fromkeys(self.spec.shards))
        extra = self.describe_extra()
        detected = f"; detected: {self.spec.detected}" if self.spec.detected else ""
        return (f"reading {self.label}: {', '.join(parts)}; {files} {self.suffix.lstrip('.') or 'data'} file(s)"
                + (f", {extra}" if extra else "") + detected)

    def describe_key(self) -> str:
        """Where the keys come from, as the start-up line says it."""
        return self.spec.fields.key or "none (file/row)"

    def describe_extra(self) -> str:
        """More of the announcement (what the files hold); it reads only what it guards, since a
        broken file is a failed unit when it is read, never a crash of the announcement."""
        return ""

    # -- writing -----------------------------------------------------------------------------

    def check_rewritable(self) -> None:
        """Refuse to copy a dataset whose copy could not be read (images named by relative path)."""

    def copy_root(self) -> str | None:
        """Where a rewritten copy finds the images this dataset names by path (None: it holds its images)."""
        return None

    def output_name(self, shard: str) -> str:
        """The file name a rewritten copy of `shard` gets (corrupt keeps names)."""
        return os.path.basename(shard)

    def write_kept(self, kept: KeptRows, tmp: Path, prefix: str, shard_size: int, shard_bytes: float,
                   progress: Callable[[str], None] | None) -> Written:
        """Filter: the kept samples, every member or column as stored, as new files under `tmp`."""
        raise NotImplementedError

    def kept_bytes(self, kept: KeptRows, shard: str, failures: list[dict]) -> tuple[int, np.ndarray]:
        """Filter's dry run: (bytes of the scored rows, bytes each rule keeps) of one shard."""
        raise NotImplementedError

    def bytes_estimated(self) -> bool:
        return False

    def rewrite(self, shard: str, tmp: Path, next_caption: NextCaption, caption_field: str) -> None:
        """Corrupt: copy `shard` into `tmp` under `output_name(shard)`, each pair's caption replaced
        by `next_caption(shard, index, key)` when it gives one, everything else as stored."""
        raise NotImplementedError

    def manifest_fields(self) -> dict:
        """The fields a manifest of a rewritten copy records."""
        from dataclasses import asdict

        return {k: v for k, v in asdict(self.spec.fields).items() if v is not None}
