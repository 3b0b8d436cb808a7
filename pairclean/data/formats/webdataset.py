"""WebDataset tar shards: one sample per key, one member per field (`KEY.jpg`, `KEY.txt`, `KEY.json`).

Read with the reader's tar rules (`data.reader`). Filter re-packs the kept samples, members byte
for byte, into new shards; corrupt copies each shard under its own name with the caption changed
wherever the text field reads it: the text member, and the json member's caption key.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from pairclean.data.formats.base import (Claim, Decisions, InputFormat, KeptRows, NextCaption, Written, changed,
                                         check_key, register_format)
from pairclean.data.reader import (Sample, UnitFailure, list_samples, raise_failure, read_samples, read_tar_pairs,
                                   sample_key)
from pairclean.data.units import unit_shard
from pairclean.data.writer import write_shards
from pairclean.errors import UserError

TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def is_tar(path: str) -> bool:
    """A shard read as a tar: a .tar name, or a URL / `pipe:` command that is not a Parquet file."""
    return path.endswith(TAR_SUFFIXES) or (not path.endswith(".parquet") and ("://" in path or path.startswith("pipe:")))


def _recorder(failures: list[dict]):
    """Filter's error policy: keep what could be read, report the shard (in filter.json)."""
    def record(failure: UnitFailure) -> None:
        failures.append({"shard": failure.unit, "reason": failure.reason})

    return record


def member_named(members: dict, ext: str) -> str | None:
    """The sample's member for extension `ext` (member names keep their case in the copy)."""
    return next((k for k in members if k.lower() == ext.lower()), None)


@register_format
class WebDatasetFormat(InputFormat):
    name = "webdataset"
    label = "WebDataset tar shards"
    priority = 90
    suffix = ".tar"
    field_defaults = {"image": "jpg;jpeg;png;webp", "text": "txt", "json_text_key": "caption", "text2": "txt2",
                      "image2": "jpg2;png2;webp2", "label": "cls", "key": "__key__"}

    @classmethod
    def claim(cls, files: list[str], forced: bool = False) -> Claim | None:
        tars = [f for f in files if is_tar(f)]
        if forced or (tars and len(tars) == len(files)):
            return Claim(cls.name, tars, why="every file is a tar shard")
        return None

    # -- reading -----------------------------------------------------------------------------

    def units(self) -> list[str]:
        return list(dict.fromkeys(self.spec.shards))

    def read(self, unit: str):
        return read_tar_pairs(self.spec, unit)

    def count(self, unit: str) -> int:
        return sum(1 for _ in list_samples(unit, lambda failure: None, self.spec.allow_pipe))

    def _listing(self, shard: str) -> tuple[list[str], str | None]:
        failures: list[UnitFailure] = []
        key = self.spec.fields.key
        read = () if key in (None, "__key__") else ("json",)
        keys = [sample_key(key, s) for s in list_samples(shard, failures.append, self.spec.allow_pipe, read=read)]
        return keys, failures[0].reason if failures else None

    def rows(self, shard: str) -> tuple[int, str | None]:
        keys, failure = self._listing(shard)
        return len(keys), failure

    def keys(self, shard: str) -> list[str]:
        return self._listing(shard)[0]

    # -- filter ------------------------------------------------------------------------------

    def name_width(self) -> int:
        """Digits of a numbered output name without a prefix: those of the input's names when they
        are numbers (img2dataset's `00000.tar`, DataComp's `00000000.tar`), else 6."""
        stems = [os.path.basename(s).split(".")[0] for s in self.spec.shards]
        return len(stems[0]) if stems and all(s.isdigit() and len(s) == len(stems[0]) for s in stems) else 6

    def kept_samples(self, shard: str, dec: Decisions, written: Written) -> Iterator[Sample]:
        """The kept samples of one shard, members exactly as stored."""
        i = -1
        for i, sample in enumerate(read_samples(shard, _recorder(written.read_failures), self.spec.allow_pipe)):
            check_key(shard, dec, i, sample_key(self.spec.fields.key, sample))
            if i < len(dec.keep) and dec.keep[i]:
                written.pairs += 1
                written.bytes += sum(len(data) for data in sample.members.values())
                yield sample
        if i + 1 < len(dec.scored):
            raise changed(shard, f"it has {i + 1} samples, the scores have index {len(dec.scored) - 1}")

    def on_kept(self, shard: str, sample: Sample) -> None:
        """A kept sample is about to be written (a layout with per-shard metadata takes its row)."""

    def on_closed(self, path: Path) -> None:
        """An output shard was closed (a layout with per-shard metadata writes it beside)."""

    def write_kept(self, kept: KeptRows, tmp: Path, prefix: str, shard_size: int, shard_bytes: float,
                   progress: Callable[[str], None] | None) -> Written:
        written = Written()

        def samples() -> Iterator[dict]:
            for shard in dict.fromkeys(self.spec.shards):
                for sample in self.kept_samples(shard, kept.decisions(shard), written):
                    self.on_kept(shard, sample)
                    yield {"__key__": sample.key, **sample.members}
                if progress:
                    progress(shard)

        pattern = f"{prefix}-%06d.tar" if prefix else f"%0{self.name_width()}d.tar"
        written.files = write_shards(samples(), tmp, maxcount=shard_size, maxsize=shard_bytes, encoder=False,
                                     pattern=pattern, post=self.on_closed)
        return written

    def kept_bytes(self, kept: KeptRows, shard: str, failures: list[dict]) -> tuple[int, np.ndarray]:
        """Dry run: (bytes of the scored samples, bytes each rule keeps) from the headers."""
        dec = kept.decisions(shard)
        total, per_rule, i = 0, np.zeros(len(dec.flags), np.int64), -1
        key = self.spec.fields.key
        read = () if key in (None, "__key__") else ("json",)
        for i, sample in enumerate(list_samples(shard, _recorder(failures), self.spec.allow_pipe, read=read)):
            check_key(shard, dec, i, sample_key(key, sample))
            size = sum(len(v) if isinstance(v, bytes) else v for v in sample.members.values())
            if i < len(dec.scored) and dec.scored[i]:
                total += size
                per_rule += size * dec.flags[:, i]
        if i + 1 < len(dec.scored):
            raise changed(shard, f"it has {i + 1} samples, the scores have index {len(dec.scored) - 1}")
        return total, per_rule

    # -- corrupt -----------------------------------------------------------------------------

    def output_name(self, shard: str) -> str:
        name = os.path.basename(unit_shard(shard))
        for suffix in TAR_SUFFIXES:
            if name.endswith(suffix):
                return name[: -len(suffix)] + ".tar"
        return name + ".tar"

    def replace_caption(self, members: dict, field: str, new: str) -> None:
        """The new caption wherever the pair's text is read: the text member and the json
        member's caption key (img2dataset writes both; a reader of either sees the same text)."""
        replaced = False
        member = member_named(members, field)
        if member is not None:
            members[member] = new.encode("utf-8")
            replaced = True
        json_key = self.spec.fields.json_text_key
        member = member_named(members, "json")
        if json_key and member is not None and self.spec.pair == "image-text":
            try:
                obj = json.loads(members[member])
            except ValueError:
                obj = None
            if isinstance(obj, dict) and (json_key in obj or not replaced):
                obj[json_key] = new
                members[member] = json.dumps(obj, ensure_ascii=False).encode("utf-8")
                replaced = True
        if not replaced:
            raise UserError(f"sample has no {field!r} member and no json {json_key!r} to put a caption in")

    def rewrite(self, shard: str, tmp: Path, next_caption: NextCaption, caption_field: str) -> None:
        def samples() -> Iterator[dict]:
            for sample in read_samples(shard, raise_failure):
                new = next_caption(shard, sample.index, sample_key(self.spec.fields.key, sample))
                if new is not None:
                    self.replace_caption(sample.members, caption_field, new)
                yield {"__key__": sample.key, **sample.members}

        name = self.output_name(shard)
        pattern = f".{os.getpid()}-{name[:-4]}-%d.tar"
        (written,) = write_shards(samples(), tmp, maxcount=sys.maxsize, maxsize=float("inf"), encoder=False,
                                  pattern=pattern)
        os.replace(written, tmp / name)
