"""Dataset specs: where the pairs are and which fields hold them, from a YAML manifest or a plain path.

A manifest (manifests/*.yaml) looks like:

    name: coco-mini
    format: webdataset            # a registered input format (`data.formats`); detected when absent
    shards: shards/{000000..000002}.tar   # relative to the manifest; list, glob, brace, dir
    pair: image-text              # text-text | image-label | image-image
    fields: {image: jpg;jpeg;png;webp, text: txt, json_text_key: caption}
    truth: truth.parquet          # optional ground-truth noise labels (key, noisy)

Without a manifest, the files say what they are: `open_dataset` expands the patterns and asks the
format registry (`data.formats.detect`) which layout they are (img2dataset output, a Hugging Face
`datasets` Parquet, plain WebDataset tars ...), with its field mapping; options override both.
A scores file records the dataset it scored (`DatasetSpec.record`) and later commands reopen it
from there (`reopen_dataset`).
"""

from __future__ import annotations

import glob
import os
import string
from dataclasses import asdict, dataclass, field, fields as dc_fields
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from pairclean.config import check_choice
from pairclean.errors import ConfigError, UserError
from pairclean.ops.urls import not_regular

if TYPE_CHECKING:
    from pairclean.data.record import DatasetRecord

PAIR_KINDS = ("image-text", "text-text", "image-label", "image-image")
MANIFEST_NAME = "manifest.yaml"  # what a directory written by pairclean describes itself with
DEFAULT_LABEL_TEMPLATE = "This is a picture of {label}."
MAX_PATTERN_NAMES = 1_000_000  # a brace pattern naming more shards than this is refused, not expanded


@dataclass
class Fields:
    """Which member (tar: extension) or column (Parquet) holds each part of a pair.

    None means the format's default (`InputFormat.field_defaults`, or what detection read off the files).
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

    def resolved(self, defaults: dict) -> "Fields":
        return Fields(**{k: (v if v is not None else defaults.get(k)) for k, v in asdict(self).items()})

    def image_candidates(self, second: bool = False) -> list[str]:
        return [e.strip() for e in (self.image2 if second else self.image).split(";") if e.strip()]


@dataclass
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
        self.fields = self.fields.resolved(self.input_format.field_defaults)
        if self.sources is None:
            self.sources = list(self.shards)

    @property
    def input_format(self):
        """The format object that reads, counts, lists and rewrites this dataset (`data.formats`)."""
        from pairclean.data.formats import format_named

        return format_named(self.format, "input_format")(self)

    def as_dict(self) -> dict:
        return asdict(self)

    def record(self, fingerprint: bool = False) -> "DatasetRecord":
        """What a scores file records about the dataset it scored: enough to open it again with the
        same reading (format, the sources as given, the field mapping, the key field), and with
        `fingerprint` the fingerprints of the files read (`data.record`)."""
        from pairclean.data.record import DatasetRecord, fingerprints

        return DatasetRecord(
            format=self.format, sources=list(self.sources or self.shards), pair=self.pair,
            fields={k: v for k, v in asdict(self.fields).items() if v is not None}, key=self.fields.key,
            label_template=self.label_template if self.pair == "image-label" else None, split=self.split,
            image_root=self.image_root, name=self.name, truth=self.truth,
            files=fingerprints(self.files()) if fingerprint else None)

    def files(self) -> list[str]:
        """Every file the dataset is read from: the shards and their metadata sidecars."""
        return list(dict.fromkeys([*self.shards, *self.input_format.metadata_files()]))

    def input_paths(self) -> list[str]:
        """What an output must stay apart from (`ops.guard`): the sources named (a directory named
        is the dataset's: an output inside it would be read back as part of the data) and every
        file read, sidecars included."""
        return list(dict.fromkeys([*(self.sources or []), *self.files()]))


def _count_names(pattern: str) -> int:
    """How many names `braceexpand(pattern)` gives, counted with its grammar without making them
    (braceexpand builds every name of a range before yielding the first)."""
    import braceexpand

    total, pos, depth, start = 1, 0, 0, 0
    while pos < len(pattern):
        if pattern[pos] == "\\":
            pos += 2
            continue
        if pattern[pos] == "{":
            depth += 1
            start = pos if depth == 1 else start
        elif pattern[pos] == "}":
            depth -= 1
            if depth == 0:
                total *= _count_expression(pattern[start + 1:pos])
        pos += 1
    if depth:
        raise braceexpand.UnbalancedBracesError(pattern)
    return total


def _count_expression(expr: str) -> int:
    import braceexpand

    if match := braceexpand.int_range_re.match(expr):
        first, last, step = int(match[1]), int(match[2]), int(match[3] or 1) or 1
        return abs(last - first) // step + 1
    if match := braceexpand.char_range_re.match(expr):
        return len(braceexpand.make_char_range(*match.groups()))
    items, pos, depth, start = [], 0, 0, 0
    while pos < len(expr):
        if expr[pos] == "\\":
            pos += 2
            continue
        depth += {"{": 1, "}": -1}.get(expr[pos], 0)
        if expr[pos] == "," and depth == 0:
            items.append(expr[start:pos])
            start = pos + 1
        pos += 1
    if not items:  # not a sequence: the braces are literal, the inside is a pattern
        return _count_names(expr)
    return sum(_count_names(item) for item in items + [expr[start:]])


def _braces(pattern: str) -> list[str]:
    """webdataset's brace patterns (`shard-{000..009}.tar`); a pattern with unbalanced braces, or one
    naming more than MAX_PATTERN_NAMES shards, is a user error, named, not a crash or a hang."""
    import braceexpand

    try:
        names = _count_names(pattern)
    except braceexpand.UnbalancedBracesError:
        raise UserError(f"unbalanced braces in shard pattern {pattern!r} (a range reads like shard-{{000..009}}.tar)")
    if names > MAX_PATTERN_NAMES:
        raise UserError(f"shard pattern {pattern!r} names {names:,} shards, more than {MAX_PATTERN_NAMES:,}: "
                        "give a directory, a glob, or a list file")
    return list(braceexpand.braceexpand(pattern))


def _expand_one(pattern: str, base: Path, allow_pipe: bool) -> list[str]:
    """Expand a directory, glob, brace pattern or URL into a sorted list of shard paths."""
    if pattern.startswith("pipe:"):
        if not allow_pipe:
            raise ConfigError(f"refusing shell URL {pattern!r}: pass `allow_pipe` to run shell commands from shard lists",
                              "allow_pipe")
        return [pattern]
    if "://" in pattern:
        return [url for expanded in _braces(pattern) for url in _expand_url(expanded)]
    p = Path(pattern)
    if not p.is_absolute():
        p = base / p
    if p.is_dir():
        from pairclean.data.formats import directory_files

        return directory_files(p)
    if p.is_file():  # a file whose name has braces or glob characters is itself
        return [str(p)]
    out: list[str] = []
    for expanded in _braces(str(p)):
        if any(ch in expanded for ch in "*?["):
            out.extend(sorted(glob.glob(expanded)))
        else:
            out.append(expanded)
    return out


def _expand_url(url: str) -> list[str]:
    """An object-store or other fsspec URL: a glob (`s3://b/x/*.tar`) or a prefix ending in `/`
    listed through fsspec, sorted; any other URL as given (a missing object becomes a failed unit)."""
    if not (any(ch in url for ch in "*?[") or url.endswith("/")):
        return [url]
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url)
        found = fs.glob(path) if any(ch in url for ch in "*?[") else fs.ls(path, detail=False)
    except (ImportError, ValueError) as exc:
        raise UserError(f"cannot list {url}: {str(exc).splitlines()[0]}") from None
    except OSError as exc:
        raise UserError(f"cannot list {url}: {exc}") from None
    return sorted(fs.unstrip_protocol(p) for p in found if p.endswith((".tar", ".parquet")))


def resolve_shards(patterns: list[str] | str, base: Path | None = None, allow_pipe: bool = False,
                   check_exist: bool = True) -> list[str]:
    """Turn user patterns (dir, glob, brace, list file, URL) into the ordered list of shards."""
    base = base or Path.cwd()
    if isinstance(patterns, str):
        patterns = [patterns]
    out: list[str] = []
    for pattern in patterns:
        p = Path(pattern) if "://" not in pattern and not pattern.startswith("pipe:") else None
        if p is not None and not p.is_absolute():
            p = base / p
        if p is not None and p.is_file() and p.suffix in (".txt", ".lst", ".list"):
            lines = [ln.strip() for ln in p.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
            for line in lines:
                out.extend(_expand_one(line, p.parent, allow_pipe))
        else:
            out.extend(_expand_one(pattern, base, allow_pipe))
    if check_exist:
        local = [s for s in out if "://" not in s and not s.startswith("pipe:")]
        missing = [s for s in local if not os.path.exists(s)]
        if missing:
            raise UserError(f"shard not found: {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        special = [(s, kind) for s in local if (kind := not_regular(s))]  # a named pipe blocks its first read
        if special:
            raise UserError(f"{special[0][0]} is not a regular file ({special[0][1]}): shards are read from regular "
                            "files only")
    if not out:
        raise UserError(f"no shards found in {', '.join(patterns)}")
    return unique_shards(out)


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


def load_manifest(path: Path, allow_pipe: bool = False) -> DatasetSpec:
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"cannot read manifest {path}: {str(exc).splitlines()[0]}") from None
    if not isinstance(raw, dict) or "shards" not in raw:
        raise UserError(f"manifest {path} needs a 'shards' entry")
    known = {f.name for f in dc_fields(Fields)}
    fields_raw = raw.get("fields") or {}
    unknown = set(fields_raw) - known
    if unknown:
        raise UserError(f"manifest {path}: unknown field name(s) {sorted(unknown)}; known: {sorted(known)}")
    from pairclean.data.formats import detect

    files = resolve_shards(raw["shards"], base=path.parent, allow_pipe=allow_pipe)
    found = detect(files, raw.get("format"), raw.get("split"))
    truth = raw.get("truth")
    if truth and not Path(truth).is_absolute():
        truth = str(path.parent / truth)
    image_root = raw.get("image_root")
    if image_root and not Path(image_root).is_absolute():
        image_root = os.path.normpath(path.parent / image_root)
    spec = DatasetSpec(
        format=found.format,
        shards=found.shards,
        pair=raw.get("pair", "image-text"),
        fields=Fields(**fields_raw).resolved(found.fields),
        label_template=raw.get("label_template", DEFAULT_LABEL_TEMPLATE),
        truth=truth,
        name=raw.get("name", path.stem),
        allow_pipe=allow_pipe,
        sources=[str(path.resolve())],
        split=raw.get("split"),
        image_root=image_root,
        detected=f"{path.name} names it" if raw.get("format") else found.why,
    )
    return validate(spec)


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


def _absolute(source: str) -> str:
    """A source as given, made absolute (URLs and `pipe:` commands as they are): what is recorded."""
    return source if "://" in source or source.startswith("pipe:") or os.path.isabs(source) \
        else os.path.join(os.getcwd(), source)


def open_dataset(source: str | list[str], pair: str | None = None, fields: Fields | None = None,
                 allow_pipe: bool = False, label_template: str | None = None, format: str | None = None,
                 split: str | None = None, image_root: str | None = None) -> DatasetSpec:
    """A DatasetSpec from a manifest path or from shard patterns, its format detected from the files
    (or `format`); explicit options (the fields given in `fields`) override the manifest and detection."""
    from pairclean.data.formats import detect

    sources = [source] if isinstance(source, str) else list(source)
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
                           allow_pipe=allow_pipe, sources=[_absolute(s) for s in sources], split=split,
                           detected=found.why)
    if pair:
        spec.pair = pair
    if fields:
        spec.fields = fields.resolved(asdict(spec.fields))
    if label_template:
        spec.label_template = label_template
    if image_root:
        spec.image_root = _absolute(image_root)
    return validate(spec)


def reopen_dataset(record: "DatasetRecord | None", sources: list[str] | None = None, fields: Fields | None = None,
                   **options) -> DatasetSpec:
    """The dataset a scores file recorded (`DatasetSpec.record`), opened again with the same
    format and field mapping; `sources` given instead read those files, with the recorded mapping
    where they are the recorded format. Options (the CLI's flags) override what was recorded."""
    recorded = Fields(**{k: v for k, v in record.fields.items() if k in Fields.__dataclass_fields__}) if record \
        else Fields()
    if not sources:
        spec = open_dataset(record.sources, format=options.get("format") or record.format,
                            split=options.get("split") or record.split,
                            pair=options.get("pair") or record.pair, allow_pipe=options.get("allow_pipe", False),
                            label_template=options.get("label_template") or record.label_template,
                            image_root=options.get("image_root") or record.image_root,
                            fields=(fields or Fields()).resolved(asdict(recorded)))
        spec.name = spec.name or record.name
        spec.truth = spec.truth or record.truth
        if not options.get("format"):
            spec.detected = "the format the scores recorded"
        return spec
    spec = open_dataset(sources, pair=options.get("pair") or (record.pair if record else None), fields=fields,
                        allow_pipe=options.get("allow_pipe", False), label_template=options.get("label_template"),
                        format=options.get("format"), split=options.get("split"), image_root=options.get("image_root"))
    if record is not None and spec.format == record.format:
        spec.fields = (fields or Fields()).resolved(asdict(recorded)).resolved(asdict(spec.fields))
    return spec


def write_manifest(path: Path, spec: DatasetSpec, shards_relative_to: Path | None = None) -> None:
    """Write a manifest describing `spec` (shard paths relative to the manifest when possible)."""
    from pairclean.ops.atomic import atomic_path

    base = shards_relative_to or path.parent
    shards = [os.path.relpath(s, base) if "://" not in s else s for s in spec.shards]
    data = {"name": spec.name or path.stem, "format": spec.format, "shards": shards, "pair": spec.pair,
            "fields": spec.input_format.manifest_fields()}
    if spec.truth:
        data["truth"] = os.path.relpath(spec.truth, base)
    if spec.split:
        data["split"] = spec.split
    if spec.image_root:
        data["image_root"] = os.path.relpath(spec.image_root, base)
    if spec.pair == "image-label":
        data["label_template"] = spec.label_template
    with atomic_path(path) as tmp:
        tmp.write_text(yaml.safe_dump(data, sort_keys=False))
