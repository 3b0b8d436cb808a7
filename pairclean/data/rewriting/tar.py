"""Copying WebDataset tar shards: filter re-packs the kept samples, members byte for byte, into new
shards; corrupt copies each shard under its own name with the caption changed wherever the text
field reads it: the text member, and the json member's caption key."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Iterator

import numpy as np

from pairclean.data.formats.webdataset import TAR_SUFFIXES, WebDatasetFormat
from pairclean.data.reading.tar import Sample, list_samples, read_samples, sample_key
from pairclean.data.rewriting.base import (Decisions, KeptRows, NextCaption, Progress, Rewriter, Written, changed,
                                           check_key, rewrites)
from pairclean.data.spec import UnitFailure, raise_failure
from pairclean.data.units import unit_shard
from pairclean.data.writer import write_shards
from pairclean.errors import UserError


def _recorder(failures: list[dict]):
    """Filter's error policy: keep what could be read, report the shard (in filter.json)."""
    def record(failure: UnitFailure) -> None:
        failures.append({"shard": failure.unit, "reason": failure.reason})

    return record


def member_named(members: dict, ext: str) -> str | None:
    """The sample's member for extension `ext` (member names keep their case in the copy)."""
    return next((k for k in members if k.lower() == ext.lower()), None)


def _short_of_scores(shard: str, dec: Decisions, read: int, failures: list[dict]) -> UserError:
    """Why a shard gave fewer samples than were scored: where its read broke (`failures`, this
    shard's), the copy cannot be complete, for that reason; else it changed since it was scored."""
    if failures:
        return UserError(f"cannot copy {shard}, read {read} of its {len(dec.scored)} scored samples: "
                         f"{failures[-1]['reason']}")
    return changed(shard, f"it has {read} samples, the scores have index {len(dec.scored) - 1}")


@rewrites(WebDatasetFormat)
class TarRewriter(Rewriter):
    format: WebDatasetFormat

    # -- filter ------------------------------------------------------------------------------

    def name_width(self) -> int:
        """Digits of a numbered output name without a prefix: those of the input's names when they
        are numbers (img2dataset's `00000.tar`, DataComp's `00000000.tar`), else 6."""
        stems = [os.path.basename(s).split(".")[0] for s in self.spec.shards]
        return len(stems[0]) if stems and all(s.isdigit() and len(s) == len(stems[0]) for s in stems) else 6

    def kept_samples(self, shard: str, dec: Decisions, written: Written) -> Iterator[Sample]:
        """The kept samples of one shard, members exactly as stored."""
        i, failed = -1, len(written.read_failures)
        for i, sample in enumerate(read_samples(shard, _recorder(written.read_failures), self.spec.allow_pipe)):
            check_key(shard, dec, i, sample_key(self.spec.fields.key, sample))
            if i < len(dec.keep) and dec.keep[i]:
                written.pairs += 1
                written.bytes += sum(len(data) for data in sample.members.values())
                yield sample
        if i + 1 < len(dec.scored):
            raise _short_of_scores(shard, dec, i + 1, written.read_failures[failed:])

    def on_kept(self, shard: str, sample: Sample) -> None:
        """A kept sample is about to be written (a layout with per-shard metadata takes its row)."""

    def on_closed(self, path: Path) -> None:
        """An output shard was closed (a layout with per-shard metadata writes it beside)."""

    def write_kept(self, kept: KeptRows, tmp: Path, prefix: str, shard_size: int, shard_bytes: float,
                   progress: Progress) -> Written:
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
        total, per_rule, i, failed = 0, np.zeros(len(dec.flags), np.int64), -1, len(failures)
        key = self.spec.fields.key
        for i, sample in enumerate(list_samples(shard, _recorder(failures), self.spec.allow_pipe,
                                                read=self.format.key_members(), copy=True)):
            check_key(shard, dec, i, sample_key(key, sample))
            size = sum(len(v) if isinstance(v, bytes) else v for v in sample.members.values())
            if i < len(dec.scored) and dec.scored[i]:
                total += size
                per_rule += size * dec.flags[:, i]
        if i + 1 < len(dec.scored):
            raise _short_of_scores(shard, dec, i + 1, failures[failed:])
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
