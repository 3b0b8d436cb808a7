"""WebDataset tar shards: one sample per key, one member per field (`KEY.jpg`, `KEY.txt`, `KEY.json`).

Read with the tar stages (`data.reading.tar`): one member-skip rule, one grouping rule. Copies
(filter, corrupt) are `data.rewriting.tar`.
"""

from __future__ import annotations

from itertools import islice
from pathlib import Path

from pairclean.data.formats.base import Claim, Found, InputFormat, Need, needs_of, register_format
from pairclean.data.reading.tar import list_samples, sample_key, tar_pairs
from pairclean.data.spec import DatasetSpec, UnitFailure
from pairclean.ops.urls import is_local

TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
FIRST_SAMPLES = 16  # samples of the first shard whose members `found` lists
IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")


def is_tar(path: str) -> bool:
    """A shard read as a tar: a .tar name, or a URL / `pipe:` command that is not a Parquet file."""
    return path.endswith(TAR_SUFFIXES) or (not path.endswith(".parquet") and ("://" in path or path.startswith("pipe:")))


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

    def units(self) -> list[str]:
        return list(dict.fromkeys(self.spec.shards))

    def read(self, unit: str):
        return tar_pairs(self.spec, unit)

    def count(self, unit: str) -> int:
        return sum(1 for _ in list_samples(unit, lambda failure: None, self.spec.allow_pipe))

    def found(self) -> Found | None:
        """The member suffixes of the first shard's first samples (headers only), each an image
        or text member by its suffix."""
        first = self.spec.shards[0] if self.spec.shards else None
        if first is None or not is_local(first):
            return None
        seen = {suffix.lower() for s in islice(list_samples(first, lambda failure: None), FIRST_SAMPLES)
                for suffix in s.members}
        if not seen:  # empty or unreadable: the run says so when it reads the shard
            return None
        kinds = {suffix: "image" if suffix.rstrip("0123456789") in IMAGE_SUFFIXES else "text" for suffix in sorted(seen)}
        return Found(f"{Path(first).name} (its first {FIRST_SAMPLES} samples)", "member", kinds)

    def reads(self, spec: DatasetSpec) -> list[Need]:
        f = spec.fields

        def texts(value: str) -> tuple[str, ...]:  # a caption may stand in the json member
            return (value.lower(), "json") if value == f.text and f.json_text_key else (value.lower(),)

        return needs_of(spec, lambda second: tuple(e.lower() for e in f.image_candidates(second)), texts)

    def key_members(self) -> tuple[str, ...]:
        """The members whose bytes a key is read from (the json member, when the key is one of its keys)."""
        return () if self.spec.fields.key in (None, "__key__") else ("json",)

    def _listing(self, shard: str) -> tuple[list[str], str | None]:
        failures: list[UnitFailure] = []
        keys = [sample_key(self.spec.fields.key, s)
                for s in list_samples(shard, failures.append, self.spec.allow_pipe, read=self.key_members())]
        return keys, failures[0].reason if failures else None

    def rows(self, shard: str) -> tuple[int, str | None]:
        keys, failure = self._listing(shard)
        return len(keys), failure

    def keys(self, shard: str) -> list[str]:
        return self._listing(shard)[0]
