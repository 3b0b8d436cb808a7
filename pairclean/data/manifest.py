"""YAML manifests: a dataset described in a file, read into a spec and written for a copy.

A manifest (manifests/*.yaml) looks like:

    name: coco-mini
    format: webdataset            # a registered input format (`data.formats`); detected when absent
    shards: shards/{000000..000002}.tar   # relative to the manifest; list, glob, brace, dir
    pair: image-text              # text-text | image-label | image-image
    fields: {image: jpg;jpeg;png;webp, text: txt, json_text_key: caption}
    truth: truth.parquet          # optional ground-truth noise labels (key, noisy)

A directory that `corrupt` or `filter` wrote describes itself with one (`spec.MANIFEST_NAME`).
"""

from __future__ import annotations

import os
from dataclasses import fields as dc_fields
from pathlib import Path

import yaml

from pairclean.data.formats import detect, format_named
from pairclean.data.patterns import resolve_shards
from pairclean.data.spec import DEFAULT_LABEL_TEMPLATE, DatasetSpec, Fields, validate
from pairclean.errors import UserError
from pairclean.ops.atomic import atomic_path


def load_manifest(path: Path, allow_pipe: bool = False) -> DatasetSpec:
    """The spec a manifest describes, its shards resolved against the manifest's folder and its
    format detected when it names none."""
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


def write_manifest(path: Path, spec: DatasetSpec, shards_relative_to: Path | None = None) -> None:
    """Write a manifest describing `spec` (shard paths relative to the manifest when possible; the
    fields as its format reads them, defaults filled in)."""
    base = shards_relative_to or path.parent
    shards = [os.path.relpath(s, base) if "://" not in s else s for s in spec.shards]
    fields = spec.fields.resolved(format_named(spec.format).field_defaults)
    data = {"name": spec.name or path.stem, "format": spec.format, "shards": shards, "pair": spec.pair,
            "fields": fields.given()}
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
