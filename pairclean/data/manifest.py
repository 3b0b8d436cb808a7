"""Dataset specs: where the pairs are and which fields hold them, from a YAML manifest or a plain path.

A manifest (manifests/*.yaml) looks like:

    name: coco-mini
    format: webdataset            # or parquet
    shards: shards/{000000..000002}.tar   # relative to the manifest; list, glob, brace, dir
    pair: image-text              # text-text | image-label | image-image
    fields: {image: jpg;jpeg;png;webp, text: txt, json_text_key: caption}
    truth: truth.parquet          # optional ground-truth noise labels (key, noisy)
"""

from __future__ import annotations

import glob
import os
import string
from dataclasses import asdict, dataclass, field, fields as dc_fields
from pathlib import Path

import yaml

from pairclean.config import check_choice
from pairclean.errors import ConfigError, UserError

PAIR_KINDS = ("image-text", "text-text", "image-label", "image-image")
FORMATS = ("webdataset", "parquet")
MANIFEST_NAME = "manifest.yaml"  # what a directory written by pairclean describes itself with
DEFAULT_LABEL_TEMPLATE = "This is a picture of {label}."


WDS_FIELD_DEFAULTS = {"image": "jpg;jpeg;png;webp", "text": "txt", "json_text_key": "caption", "text2": "txt2",
                      "image2": "jpg2;png2;webp2", "label": "cls", "key": "__key__"}
PARQUET_FIELD_DEFAULTS = {"image": "image", "text": "caption", "json_text_key": None, "text2": "caption2",
                          "image2": "image2", "label": "label", "key": "key"}


@dataclass
class Fields:
    """Which member (WebDataset extension) or column (Parquet) holds each part of a pair.

    None means the format's default (WDS_FIELD_DEFAULTS / PARQUET_FIELD_DEFAULTS).
    """

    image: str | None = None  # extensions tried in order (';'-separated), or the Parquet bytes column
    image_path: str | None = None  # Parquet: column of image paths relative to the file
    text: str | None = None  # extension or column of the caption
    json_text_key: str | None = None  # caption inside a `json` member when there is no text member
    text2: str | None = None  # second text of a text-text pair
    image2: str | None = None  # second image of an image-image pair
    image2_path: str | None = None
    label: str | None = None  # class label of an image-label pair
    key: str | None = None  # Parquet id column (WebDataset always uses __key__)

    def resolved(self, format: str) -> "Fields":
        defaults = PARQUET_FIELD_DEFAULTS if format == "parquet" else WDS_FIELD_DEFAULTS
        return Fields(**{k: (v if v is not None else defaults.get(k)) for k, v in asdict(self).items()})

    def image_candidates(self, second: bool = False) -> list[str]:
        return [e.strip() for e in (self.image2 if second else self.image).split(";") if e.strip()]


@dataclass
class DatasetSpec:
    format: str  # "webdataset" | "parquet"
    shards: list[str]
    pair: str = "image-text"
    fields: Fields = field(default_factory=Fields)
    label_template: str = DEFAULT_LABEL_TEMPLATE
    truth: str | None = None
    name: str | None = None
    allow_pipe: bool = False

    def __post_init__(self):
        self.fields = self.fields.resolved(self.format)

    def as_dict(self) -> dict:
        return asdict(self)


def _braces(pattern: str) -> list[str]:
    """webdataset's brace patterns (`shard-{000..009}.tar`); a pattern with unbalanced braces is a
    user error, named, not a crash."""
    import braceexpand

    try:
        return list(braceexpand.braceexpand(pattern))
    except braceexpand.UnbalancedBracesError:
        raise UserError(f"unbalanced braces in shard pattern {pattern!r} (a range reads like shard-{{000..009}}.tar)")


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
        found = sorted(str(x) for x in p.iterdir() if x.suffix in (".tar", ".parquet") and x.is_file())
        return found
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
        missing = [s for s in out if "://" not in s and not s.startswith("pipe:") and not os.path.exists(s)]
        if missing:
            raise UserError(f"shard not found: {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
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


def detect_format(shards: list[str]) -> str:
    kinds = {"parquet" if s.endswith(".parquet") else "webdataset" for s in shards}
    if len(kinds) > 1:
        raise UserError("mixed .tar and .parquet inputs: score them separately")
    return kinds.pop()


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
    shards = resolve_shards(raw["shards"], base=path.parent, allow_pipe=allow_pipe)
    truth = raw.get("truth")
    if truth and not Path(truth).is_absolute():
        truth = str(path.parent / truth)
    spec = DatasetSpec(
        format=raw.get("format") or detect_format(shards),
        shards=shards,
        pair=raw.get("pair", "image-text"),
        fields=Fields(**fields_raw),
        label_template=raw.get("label_template", DEFAULT_LABEL_TEMPLATE),
        truth=truth,
        name=raw.get("name", path.stem),
        allow_pipe=allow_pipe,
    )
    return validate(spec)


def validate(spec: DatasetSpec) -> DatasetSpec:
    check_choice(spec.pair, PAIR_KINDS, "pair")
    check_choice(spec.format, FORMATS, "format")
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


def open_dataset(source: str | list[str], pair: str | None = None, fields: Fields | None = None,
                 allow_pipe: bool = False, label_template: str | None = None) -> DatasetSpec:
    """A DatasetSpec from a manifest path or from shard patterns; explicit options override the manifest."""
    sources = [source] if isinstance(source, str) else list(source)
    if len(sources) == 1 and (Path(sources[0]) / MANIFEST_NAME).is_file():
        sources = [str(Path(sources[0]) / MANIFEST_NAME)]  # a directory `corrupt` or `filter` wrote
    if len(sources) == 1 and sources[0].endswith((".yaml", ".yml")):
        path = Path(sources[0])
        if not path.exists():
            raise UserError(f"manifest not found: {path}")
        spec = load_manifest(path, allow_pipe=allow_pipe)
    else:
        for s in sources:
            if "://" not in s and not s.startswith("pipe:") and not any(c in s for c in "*?{[") and not Path(s).exists():
                raise UserError(f"path not found: {s}")
        shards = resolve_shards(sources, allow_pipe=allow_pipe)
        spec = DatasetSpec(format=detect_format(shards), shards=shards, allow_pipe=allow_pipe)
    if pair:
        spec.pair = pair
    if fields:
        spec.fields = fields.resolved(spec.format)
    if label_template:
        spec.label_template = label_template
    return validate(spec)


def write_manifest(path: Path, spec: DatasetSpec, shards_relative_to: Path | None = None) -> None:
    """Write a manifest describing `spec` (shard paths relative to the manifest when possible)."""
    from pairclean.ops.atomic import atomic_path

    base = shards_relative_to or path.parent
    shards = [os.path.relpath(s, base) if "://" not in s else s for s in spec.shards]
    data = {"name": spec.name or path.stem, "format": spec.format, "shards": shards, "pair": spec.pair,
            "fields": {k: v for k, v in asdict(spec.fields).items() if v is not None}}
    if spec.truth:
        data["truth"] = os.path.relpath(spec.truth, base)
    if spec.pair == "image-label":
        data["label_template"] = spec.label_template
    with atomic_path(path) as tmp:
        tmp.write_text(yaml.safe_dump(data, sort_keys=False))
