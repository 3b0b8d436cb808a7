"""The dataset a run recorded, and how later commands tell it is still the same dataset.

A scores file (and a saved-embeddings directory) records the dataset it was made from: how to
open it again (format, sources, field mapping: `Dataset.record`, `reopen_dataset`) and a
fingerprint of each file read (size and the SHA-1 of its first 64 KiB, taken when the run
finished). Two files that record datasets are joined only when the datasets agree, and a
command that reads the recorded dataset again checks the files it reads: img2dataset names
every download's shards and keys alike (`00000.tar`, `000000012`), so only the bytes tell two
downloads, or a shard rewritten since it was scored, apart. Files are compared by name (a moved
or copied dataset is the same dataset); a file only one side has is no conflict (a subset).
`allow_other_dataset` lets a user join them anyway; the key check of rows looked up by position
(`data.formats.base.check_key`) is never waived.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from pairclean.data.spec import MANIFEST_NAME, PAIR_KINDS, Fields
from pairclean.errors import ConfigError
from pairclean.ops.records import Keyed, Record
from pairclean.ops.urls import is_local

HEAD_BYTES = 64 << 10  # the bytes of a file's start its fingerprint hashes


@dataclass(frozen=True)
class FileFingerprint(Record):
    """A file as a run read it: where, how big, and a hash of its first HEAD_BYTES bytes."""

    what = "file fingerprint"
    path: str
    size: int
    head_sha1: str

    @classmethod
    def of(cls, path: str) -> "FileFingerprint | None":
        """The fingerprint of a local regular file (None: a URL, or no such file)."""
        if not is_local(path):
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as fh:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                return None
            head = fh.read(HEAD_BYTES)
        return cls(os.path.abspath(path), info.st_size, hashlib.sha1(head).hexdigest())

    def problems(self) -> Iterator[tuple[str, str]]:
        if self.size < 0:
            yield "size", f"must be 0 or more, got {self.size}"
        if len(self.head_sha1) != 40 or any(c not in "0123456789abcdef" for c in self.head_sha1):
            yield "head_sha1", "must be 40 lower-case hex digits"

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def differs(self, other: "FileFingerprint") -> str | None:
        """How two fingerprints of files of one name differ (None: they agree)."""
        if self.size != other.size:
            return f"{self.size:,} bytes, not {other.size:,}"
        if self.head_sha1 != other.head_sha1:
            return "the same size, other bytes"
        return None


def fingerprints(paths: Iterable[str]) -> list[FileFingerprint]:
    """The fingerprints of the local regular files among `paths`, each once."""
    found = (FileFingerprint.of(p) for p in dict.fromkeys(paths))
    return [f for f in found if f is not None]


@dataclass(frozen=True)
class DatasetRecord(Record):
    """The dataset a scores file (or a saved-embeddings directory) was made from: every later
    command opens it again from here, so none needs a shard list or field flags (flags still
    override). Embeddings record their layout here too (`fields`: left, right, key), with the
    dataset of pairs they describe in `pairs` when it is known."""

    what = "dataset record"
    format: str  # the input format (`data.formats`): webdataset, img2dataset-parquet, hf-parquet, clip-retrieval ...
    sources: list[str]  # what the user named (patterns, directories, a manifest), made absolute
    pair: str | None = None
    fields: dict[str, str | None] = field(default_factory=dict)  # which member or column held each side
    key: str | None = None  # the field the rows' `key` came from
    label_template: str | None = None
    split: str | None = None
    image_root: str | None = None
    name: str | None = None
    truth: str | None = None  # a dataset `corrupt` wrote names its truth file
    pairs: "DatasetRecord | None" = None  # embeddings: the dataset of pairs they describe, when known
    files: list[FileFingerprint] | None = None  # the files read (shards, sidecars), when the run finished

    def problems(self) -> Iterator[tuple[str, str]]:
        if self.pair is not None and self.pair not in PAIR_KINDS:
            yield "pair", f"must be one of {', '.join(PAIR_KINDS)}, got {self.pair!r}"
        known = {*Fields.__dataclass_fields__, "left", "right"}
        for name in self.fields:
            if name not in known:
                yield f"fields.{name}", "unknown field"

    def input_paths(self) -> list[str]:
        """What an output must stay apart from (`ops.guard`) when the dataset is not opened again
        (`Dataset.input_paths` when it is): the sources named (a directory holding its manifest as
        well: what the user named), every file read, the truth file and, for embeddings, the pairs
        they describe."""
        folders = [os.path.dirname(s) for s in self.sources if os.path.basename(s) == MANIFEST_NAME]
        return list(dict.fromkeys([*folders, *self.sources, *(f.path for f in self.files or ()),
                                   *filter(None, [self.truth]),
                                   *(self.pairs.input_paths() if self.pairs is not None else [])]))

    def conflict(self, other: "DatasetRecord | None") -> str | None:
        """How the files of two recorded datasets disagree (None: no file of one name differs,
        or a side recorded no fingerprints)."""
        if other is None or self.files is None or other.files is None:
            return None
        return _conflict(self.files, other.files)


def _by_name(files: Iterable[FileFingerprint]) -> Keyed[str, FileFingerprint]:
    """File name -> fingerprint, for the names that occur once."""
    named: dict[str, list[FileFingerprint]] = {}
    for f in files:
        named.setdefault(f.name, []).append(f)
    return {name: found[0] for name, found in named.items() if len(found) == 1}


def _conflict(recorded: Iterable[FileFingerprint], current: Iterable[FileFingerprint]) -> str | None:
    mine, theirs = _by_name(recorded), _by_name(current)
    differing = [(name, theirs[name].differs(mine[name])) for name in sorted(mine.keys() & theirs.keys())]
    differing = [(name, why) for name, why in differing if why]
    if not differing:
        return None
    name, why = differing[0]
    more = f" (and {len(differing) - 1} other file(s))" if len(differing) > 1 else ""
    return f"{name}: {why}{more}"


def check_same_dataset(recorded: DatasetRecord | None, current: DatasetRecord | Iterable[str] | None, recorder: str,
                       allow_other_dataset: bool, other: str = "the files given") -> None:
    """Refuse to join `recorder` (what recorded `recorded`: "the scores file s.parquet") with a
    dataset whose files differ from the ones it recorded: `current` is another recorded dataset
    (`other` names what recorded it), or the paths about to be read (fingerprinted now).
    `allow_other_dataset` waives it."""
    if allow_other_dataset or recorded is None or recorded.files is None or current is None:
        return
    if isinstance(current, DatasetRecord):
        why = recorded.conflict(current)
    else:
        why = _conflict(recorded.files, fingerprints(current))
    if why:
        raise ConfigError(f"{recorder} records another dataset than {other} ({why}): the file changed since it "
                          "was scored, or it is another download or copy of the dataset; score the data you mean, "
                          "or pass `allow_other_dataset` to use them together anyway", "allow_other_dataset")
