"""A dataset, opened: its spec bound once to the input format that reads it.

`open_dataset` takes what a user names (a manifest, shard patterns, a directory) and returns a
`Dataset`: without a manifest the files say what they are (the format registry's `detect`: img2dataset
output, a Hugging Face `datasets` Parquet, plain WebDataset tars ...), with its field mapping;
options override both. A scores file records the dataset it scored (`DatasetSpec.record`) and later
commands open it again from there (`reopen_dataset`). Every reader goes through a `Dataset`:
`units()`, `read(unit)`, `count(unit)`, `keys(shard)`, `rows(shard)`; its `spec` is plain data with
every field resolved.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterator

from pairclean.data.formats import InputFormat, detect, format_named
from pairclean.data.manifest import load_manifest
from pairclean.data.patterns import absolute_source, resolve_shards
from pairclean.data.record import DatasetRecord, fingerprints
from pairclean.data.reading.inputs import check_protocols
from pairclean.data.spec import MANIFEST_NAME, DatasetSpec, Fields, RawPair, UnitFailure, validate
from pairclean.data.units import unique_shards
from pairclean.errors import ConfigError, UserError


@dataclass(frozen=True)
class Dataset:
    """A spec and the format that reads it, bound once: the spec's fields are resolved against the
    format's defaults here, and every read of the dataset goes through this one format object."""

    spec: DatasetSpec
    named: tuple[str, ...] = ()  # what the user named, as named (a directory holding a manifest, not the manifest)
    input_format: InputFormat = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        cls = format_named(self.spec.format, "input_format")
        object.__setattr__(self, "spec", replace(self.spec, fields=self.spec.fields.resolved(cls.field_defaults)))
        object.__setattr__(self, "input_format", cls(self.spec))

    def units(self) -> list[str]:
        """Every unit of the dataset, in a stable order (the order of the output rows), as its format
        cuts it. A shard listed twice (overlapping patterns, a repeated line in a list file) is one
        unit: its pairs would otherwise be scored, and written, twice."""
        shards = unique_shards(self.spec.shards)
        if not self.spec.allow_pipe and any(s.startswith("pipe:") for s in shards):
            raise ConfigError("refusing shell `pipe:` shard URLs: pass `allow_pipe` to run shell commands from "
                              "shard lists", "allow_pipe")
        check_protocols(shards)
        return self.input_format.units()

    def read(self, unit: str) -> Iterator[RawPair | UnitFailure]:
        """Pairs mode: the unit's pairs in order (index = position in its shard), then any UnitFailure."""
        return self.input_format.read(unit)

    def count(self, unit: str) -> int:
        """Header mode for a unit: how many rows it holds (a Parquet row group's count from the file's
        metadata, a tar shard's from its member headers), rows before a break included."""
        return self.input_format.count(unit)

    def keys(self, shard: str) -> list[str]:
        """The keys of the shard's rows by index, as the format keys them."""
        return self.input_format.keys(shard)

    def rows(self, shard: str) -> tuple[int, str | None]:
        """(pairs in the shard that a writer can copy, why the listing stopped early)."""
        return self.input_format.rows(shard)

    def files(self) -> list[str]:
        """Every file the dataset is read from: the shards and their metadata sidecars."""
        return list(dict.fromkeys([*self.spec.shards, *self.input_format.metadata_files()]))

    def input_paths(self) -> list[str]:
        """What an output must stay apart from (`ops.guard`): what the user named (a directory
        named is the dataset's, a directory holding a manifest included: an output inside it would
        be read back as part of the data) and every file read, sidecars included."""
        return list(dict.fromkeys([*(self.named or self.spec.sources or ()), *self.files()]))

    def check_fields(self) -> None:
        """Refuse, before a model is built, fields that the first shard does not hold (one line
        naming the setting; `InputFormat.check_fields`)."""
        self.input_format.check_fields()

    def describe(self) -> str:
        """The one line a run over the dataset starts with."""
        return self.input_format.describe()

    def record(self, fingerprint: bool = False) -> DatasetRecord:
        """What a scores file records about the dataset it scored: enough to open it again with the
        same reading (format, the sources as given, the field mapping, the key field), and with
        `fingerprint` the fingerprints of the files read (`data.record`)."""
        spec = self.spec
        return DatasetRecord(
            format=spec.format, sources=list(spec.sources or spec.shards), pair=spec.pair, fields=spec.fields.given(),
            key=spec.fields.key, label_template=spec.label_template if spec.pair == "image-label" else None,
            split=spec.split, image_root=spec.image_root, name=spec.name, truth=spec.truth,
            files=fingerprints(self.files()) if fingerprint else None)


def as_dataset(source: str | list[str] | DatasetSpec | Dataset, **options) -> Dataset:
    """What a library function was handed, as a Dataset: a Dataset as it is, a spec bound to its
    format, a name (manifest, patterns) opened with `options` (`open_dataset`'s)."""
    if isinstance(source, Dataset):
        return source
    if isinstance(source, DatasetSpec):
        return Dataset(source)
    return open_dataset(source, **options)


def open_dataset(source: str | list[str], pair: str | None = None, fields: Fields | None = None,
                 allow_pipe: bool = False, label_template: str | None = None, format: str | None = None,
                 split: str | None = None, image_root: str | None = None) -> Dataset:
    """The dataset a manifest path or shard patterns name, its format detected from the files
    (or `format`); explicit options (the fields given in `fields`) override the manifest and detection."""
    sources = [source] if isinstance(source, str) else list(source)
    named = tuple(absolute_source(s) for s in sources)
    if len(sources) == 1 and (Path(sources[0]) / MANIFEST_NAME).is_file():
        sources = [str(Path(sources[0]) / MANIFEST_NAME)]  # a directory `corrupt` or `filter` wrote
    if len(sources) == 1 and sources[0].endswith((".yaml", ".yml")):
        path = Path(sources[0])
        if not path.exists():
            raise UserError(f"manifest not found: {path}")
        spec = load_manifest(path, allow_pipe=allow_pipe)
        if (format or spec.format) != spec.format or (split or spec.split) != spec.split:
            raise ConfigError(f"{path} names its format ({spec.format}) and split ({spec.split}): edit the manifest "
                              "instead of setting `input_format` or `split`", "input_format", "split")
    else:
        for s in sources:
            if "://" not in s and not s.startswith("pipe:") and not any(c in s for c in "*?{[") and not Path(s).exists():
                raise UserError(f"path not found: {s}")
        found = detect(resolve_shards(sources, allow_pipe=allow_pipe), format, split)
        spec = DatasetSpec(format=found.format, shards=found.shards, fields=Fields().resolved(found.fields),
                           allow_pipe=allow_pipe, sources=[absolute_source(s) for s in sources], split=split,
                           detected=found.why)
    spec = replace(spec, pair=pair or spec.pair, fields=fields.resolved(asdict(spec.fields)) if fields else spec.fields,
                   label_template=label_template or spec.label_template,
                   image_root=absolute_source(image_root) if image_root else spec.image_root)
    return Dataset(validate(spec), named)


def reopen_dataset(record: DatasetRecord | None, sources: list[str] | None = None, fields: Fields | None = None,
                   **options) -> Dataset:
    """The dataset a scores file recorded (`Dataset.record`), opened again with the same format and
    field mapping; `sources` given instead read those files, with the recorded mapping where they
    are the recorded format. Options (the CLI's flags) override what was recorded."""
    recorded = Fields(**{k: v for k, v in record.fields.items() if k in Fields.__dataclass_fields__}) if record \
        else Fields()
    if not sources:
        spec = open_dataset(record.sources, format=options.get("format") or record.format,
                            split=options.get("split") or record.split,
                            pair=options.get("pair") or record.pair, allow_pipe=options.get("allow_pipe", False),
                            label_template=options.get("label_template") or record.label_template,
                            image_root=options.get("image_root") or record.image_root,
                            fields=(fields or Fields()).resolved(asdict(recorded))).spec
        return Dataset(replace(spec, name=spec.name or record.name, truth=spec.truth or record.truth,
                               detected=spec.detected if options.get("format") else "the format the scores recorded"))
    spec = open_dataset(sources, pair=options.get("pair") or (record.pair if record else None), fields=fields,
                        allow_pipe=options.get("allow_pipe", False), label_template=options.get("label_template"),
                        format=options.get("format"), split=options.get("split"),
                        image_root=options.get("image_root")).spec
    if record is not None and spec.format == record.format:
        spec = replace(spec, fields=(fields or Fields()).resolved(asdict(recorded)).resolved(asdict(spec.fields)))
    return Dataset(spec)
