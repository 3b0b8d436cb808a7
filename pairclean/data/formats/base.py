"""What an input format is, and the registry that finds one for a list of files.

A format is one class: how it recognises its files (`claim`), the field mapping it reads by
default, how it cuts a dataset into units, reads a unit into pairs (composing the stages of
`data.reading`), counts and keys rows, lists a directory, and the one line that says how a run
reads it (`describe`). An instance reads one dataset (`data.dataset.Dataset` binds a spec to its
format once); classes register by name with `@register_format`, and detection asks each class in
`priority` order whether the files are its layout. Copying a dataset (filter, corrupt) is not a
format's job: `data.rewriting` does it, for the formats that can be copied.
"""

from __future__ import annotations

import difflib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar, Iterator

from pairclean.config import check_choice
from pairclean.data.spec import PAIR_KINDS, DatasetSpec, Fields, RawPair, UnitFailure
from pairclean.errors import ConfigError, UserError

REGISTRY: dict[str, type["InputFormat"]] = {}
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".parquet")  # what a directory listing offers detection


def register_format(cls: type["InputFormat"]) -> type["InputFormat"]:
    """Add a format class to the registry under its `name`."""
    REGISTRY[cls.name] = cls
    return cls


def format_named(name: str, field: str = "input_format") -> type["InputFormat"]:
    """The registered format class of that name (a ConfigError naming `field` otherwise)."""
    check_choice(name, list(REGISTRY), field, "input format")
    return REGISTRY[name]


@dataclass
class Claim:
    """What detection found: the format, the files it reads as shards, the fields it read off them,
    and why the files are that layout (the run's announcement says it)."""

    format: str
    shards: list[str]
    fields: dict[str, str | None] = field(default_factory=dict)
    why: str = ""


def by_priority() -> list[type["InputFormat"]]:
    return sorted(REGISTRY.values(), key=lambda c: c.priority)


def directory_files(directory: Path) -> list[str]:
    """The files a directory offers as a dataset: a format's own listing rule (a Hugging Face hub
    folder keeps its files under data/), else its shard files."""
    for cls in by_priority():
        found = cls.directory_files(directory)
        if found is not None:
            return found
    return sorted(str(p) for p in directory.iterdir() if p.name.endswith(SHARD_SUFFIXES) and p.is_file())


def detect(files: list[str], format: str | None = None, split: str | None = None) -> Claim:
    """The format of these files (`format` forces one: it then takes the files it can read), the
    shards it reads (of `split` only, when given), and the fields it found."""
    if format is not None:
        cls = format_named(format, "input_format")
        claim = cls.claim(files, forced=True) or Claim(cls.name, [])  # none of the files is of its kind
        claim.why = f"{format} was named as the input format"
    else:
        claim = next((c for c in (cls.claim(files) for cls in by_priority()) if c is not None), None)
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


@dataclass(frozen=True)
class Need:
    """What a pair kind reads from each pair: `what` it is (images, captions), its `kind` (image or
    text), the member or column names that may hold it (`names`: the first present is read), and
    the settings that name it (`fields`: the first names the stored value, the second a path)."""

    what: str
    kind: str
    names: tuple[str, ...]
    fields: tuple[str, ...]


@dataclass(frozen=True)
class Found:
    """What a dataset's first shard holds (`InputFormat.found`): where it looked (`where`: a
    file, or its first samples), what it calls an entry (`noun`: column or member) and each
    entry's kind (image, text, or other)."""

    where: str
    noun: str
    entries: dict[str, str]


def needs_of(spec: DatasetSpec, image_names, text_names) -> list[Need]:
    """What `spec`'s pair kind reads, by the format's naming (`image_names(second)`,
    `text_names(field value)`: the member or column names one field looks in)."""
    f = spec.fields
    image = Need("images", "image", image_names(False), ("image_field", "image_path_field"))
    right = {"image-text": Need("captions", "text", text_names(f.text), ("text_field",)),
             "image-label": Need("labels", "text", text_names(f.label), ("label_field",)),
             "image-image": Need("second images", "image", image_names(True), ("image2_field", "image2_path_field"))}
    if spec.pair == "text-text":
        return [Need("texts", "text", text_names(f.text), ("text_field",)),
                Need("second texts", "text", text_names(f.text2), ("text2_field",))]
    return [image, right[spec.pair]]


def _suggestion(need: Need, found: Found, taken: set[str]) -> str:
    """What `need` may have meant, among the entries no other field reads (`taken`): one of its
    kind with a close name (case-blind), else those of its kind, else (none of its kind) one with a
    close name."""
    free = [name for name in found.entries if name not in taken]
    fitting = [name for name in free if found.entries[name] == need.kind]

    def close(names: list[str]) -> list[str]:
        lowered = {name.lower(): name for name in names}
        return [lowered[m] for looked in need.names for m in difflib.get_close_matches(looked.lower(), lowered, 1, 0.6)]

    if near := close(fitting) or ([] if fitting else close(free)):
        return f"did you mean {near[0]!r}?"
    return f"its {need.kind} {found.noun}s: {', '.join(fitting)}" if fitting else ""


def missing_fields_error(found: Found, missing: list[Need], taken: set[str], fits: list[str]) -> ConfigError:
    """One line naming each missing entry, the setting that names it with what it may have meant
    (an entry no other field reads: not one of `taken`), what the shard holds, and the pair kinds
    its entries fit."""
    parts = []
    for need in missing:
        names = " or ".join(repr(n) for n in need.names[:4])
        setting = f"`{need.fields[0]}`" + (f", or `{need.fields[1]}` for paths" if len(need.fields) > 1 else "")
        hint = _suggestion(need, found, taken)
        parts.append(f"no {found.noun} {names} for the {need.what} (name it with {setting}"
                     + (f"; {hint})" if hint else ")"))
    held = f"its {found.noun}s: {', '.join(found.entries)}"
    fit = f"; they hold {' or '.join(fits)} pairs (`pair` {fits[0]})" if fits else ""
    fields = [f for need in missing for f in need.fields] + (["pair"] if fits else [])
    return ConfigError(f"{found.where} has {' and '.join(parts)}; {held}{fit}", *dict.fromkeys(fields))


class InputFormat(ABC):
    """One way pairs are stored. Subclasses set the class attributes and the methods their
    layout needs; an instance reads one dataset (`self.spec`, its fields resolved)."""

    name: ClassVar[str]
    label: ClassVar[str]  # how the announcement names it: "img2dataset webdataset output"
    priority: ClassVar[int] = 100  # detection asks lower numbers first: a specific layout before a generic one
    suffix: ClassVar[str] = ""  # the data files' suffix
    field_defaults: ClassVar[dict[str, str | None]] = {}

    def __init__(self, spec: DatasetSpec):
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
    def read(self, unit: str) -> Iterator[RawPair | UnitFailure]:
        """The unit's pairs in order (index = position in its shard), then any UnitFailure."""

    @abstractmethod
    def count(self, unit: str) -> int:
        """How many rows the unit holds, from headers or metadata."""

    @abstractmethod
    def rows(self, shard: str) -> tuple[int, str | None]:
        """(pairs in the shard that a writer can copy, why the listing stopped early)."""

    @abstractmethod
    def keys(self, shard: str) -> list[str]:
        """The keys of the shard's rows by index."""

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

    # -- the fields, checked before a run ------------------------------------------------------

    def found(self) -> Found | None:
        """What the first shard holds, read cheaply (a schema, a few member headers); None when the
        format cannot tell, or the shard is not a local file (a run reports it when it reads it)."""
        return None

    def reads(self, spec: DatasetSpec) -> list[Need]:
        """What `spec`'s pair kind reads, in this format's names (`needs_of`)."""
        return []

    def check_fields(self) -> None:
        """Refuse, before a model is built, a dataset whose first shard holds nothing that one of
        the pair kind's fields names: one line naming the setting, what the shard holds, and the
        pair kinds it fits (`missing_fields_error`)."""
        found = self.found()
        if found is None:
            return
        reads = self.reads(self.spec)
        missing = [need for need in reads if not any(n in found.entries for n in need.names)]
        if not missing:
            return
        taken = {n for need in reads if need not in missing for n in need.names} | {self.spec.fields.key}
        fits = [kind for kind in PAIR_KINDS if kind != self.spec.pair and all(
            any(n in found.entries for n in need.names)
            for need in self.reads(replace(self.spec, pair=kind, fields=Fields().resolved(self.field_defaults))))]
        raise missing_fields_error(found, missing, taken, fits)
