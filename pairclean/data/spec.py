"""What a dataset is, as plain data: the spec every other module of `data` reads, and the records
its reading yields. Nothing here opens a file or knows a format's class: the formats
(`data.formats`) read a spec, and `data.dataset` binds one to its format.

    DatasetSpec   where the shards are, their format's name, the pair kind, which member or
                  column holds each side (`Fields`), the label template, what the user named
                  (what a run records of it is `data.record.DatasetRecord`, made by `Dataset.record`)
    RawPair       one row as read: (shard, index, key) and the two sides' raw values, or an error
    UnitFailure   why a unit stopped early, handed to the caller's error policy
"""

from __future__ import annotations

import string
from dataclasses import asdict, dataclass, field
from typing import Callable

from pairclean.config import check_choice
from pairclean.errors import ConfigError, UserError
from pairclean.ops.records import Keyed

PAIR_KINDS = ("image-text", "text-text", "image-label", "image-image")
MANIFEST_NAME = "manifest.yaml"  # what a directory written by pairclean describes itself with
DEFAULT_LABEL_TEMPLATE = "This is a picture of {label}."
_MODALITIES = {"image-text": ("image", "text"), "text-text": ("text", "text"), "image-label": ("image", "text"),
               "image-image": ("image", "image")}


def modalities(pair: str) -> tuple[str, str]:
    """(left, right) modality of a pair kind: what an encoder must take on each side."""
    return _MODALITIES[pair]


@dataclass(frozen=True)
class Fields:
    """Which member (tar: extension) or column (Parquet) holds each part of a pair.

    None means the format's default (`InputFormat.field_defaults`, or what detection read off the
    files); a `Dataset` holds its spec with every default filled in.
    """

    image: str | None = None  # extensions tried in order (';'-separated), or the Parquet image column
    image_path: str | None = None  # Parquet: column of image paths relative to the dataset root
    text: str | None = None  # extension or column of the caption
    json_text_key: str | None = None  # caption inside a `json` member when there is no text member
    text2: str | None = None  # second text of a text-text pair
    image2: str | None = None  # second image of an image-image pair
    image2_path: str | None = None
    label: str | None = None  # class label of an image-label pair
    key: str | None = None  # Parquet: key column; tar: `__key__` (the member names) or a key of the json member

    def resolved(self, defaults: dict) -> Fields:
        """These fields, each one not given taken from `defaults`."""
        return Fields(**{k: (v if v is not None else defaults.get(k)) for k, v in asdict(self).items()})

    def given(self) -> Keyed[str, str]:
        """The fields that are set, by name (what a manifest or a record writes)."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    def image_candidates(self, second: bool = False) -> list[str]:
        return [e.strip() for e in (self.image2 if second else self.image).split(";") if e.strip()]


@dataclass(frozen=True)
class DatasetSpec:
    format: str  # a registered input format (`data.formats`): webdataset, parquet, img2dataset-webdataset, ...
    shards: list[str]
    pair: str = "image-text"
    fields: Fields = field(default_factory=Fields)
    label_template: str = DEFAULT_LABEL_TEMPLATE
    truth: str | None = None
    name: str | None = None
    allow_pipe: bool = False
    sources: list[str] | None = None  # what the user named (patterns, directories, a manifest), absolute
    split: str | None = None  # Hugging Face layouts: the split read (None: all)
    image_root: str | None = None  # where relative image paths start (None: the format's rule)
    detected: str | None = None  # why the files were taken for this format (the run's announcement says it)

    def __post_init__(self):
        if self.sources is None:
            object.__setattr__(self, "sources", list(self.shards))


def validate(spec: DatasetSpec) -> DatasetSpec:
    check_choice(spec.pair, PAIR_KINDS, "pair")
    if spec.pair == "image-label":
        check_label_template(spec.label_template)
    return spec


def check_label_template(template: str) -> None:
    """The template is formatted once per pair: it must name {label} and no other field."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
        template.format(label="x")
    except (ValueError, KeyError, IndexError, AttributeError) as exc:
        raise UserError(f"label template {template!r} is not a valid format string ({exc})") from None
    if names != {"label"}:
        raise UserError(f"label template {template!r} must contain {{label}} and no other field, "
                        f'e.g. "{DEFAULT_LABEL_TEMPLATE}"')


# -- what reading yields -------------------------------------------------------------------------


@dataclass
class RawPair:
    """One row as read: its place (`shard`, `index`), its key, and the stored values of its two
    sides (image bytes or text), or why it has none (`error`: the row is kept as an error row)."""

    key: str
    shard: str
    index: int
    left: bytes | str | None = None
    right: bytes | str | None = None
    error: str | None = None


@dataclass
class UnitFailure:
    """Why a unit ended before its last row: the rows read before it are kept."""

    unit: str
    reason: str
    fields: tuple[str, ...] = ()  # the config fields the reason names (a front end words them its way)


OnFailure = Callable[[UnitFailure], None]  # the error policy: return to keep the rows read so far, or raise


def raise_failure(failure: UnitFailure) -> None:
    """The error policy of commands that copy shards whole: a shard that breaks stops the command."""
    message = f"cannot read {failure.unit}: {failure.reason}"
    raise ConfigError(message, *failure.fields) if failure.fields else UserError(message)
