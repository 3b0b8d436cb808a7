"""Hugging Face `datasets` Parquet: the files `push_to_hub` uploads and `Dataset.to_parquet` writes.

Recognised by the schema metadata `huggingface`, whose features name the image column (`_type:
Image`), whatever it is called. An Image value is a struct {bytes, path}: the bytes when the image
is embedded (what the hub holds), else a path relative to the dataset root (the folder holding
`data/`, or `image_root`). The hub's layout keeps the files under `data/` named
`{split}-{index:05d}-of-{count:05d}.parquet` (datasets/arrow_dataset.py); naming the dataset's root
reads `data/`, and `split` picks one split (by default all, announced). The caption is the
`text` or `caption` column, the key the `id` column (rows are keyed by position without one).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pairclean.data.formats.base import SHARD_SUFFIXES, Claim, register_format
from pairclean.data.formats.parquet import ParquetFormat
from pairclean.data.reading.inputs import parquet_file
from pairclean.errors import UserError
from pairclean.ops.urls import is_local

HUB_DATA_DIR = "data"
SPLIT_NAME = re.compile(r"(?P<split>.+?)(-\d{5}-of-\d{5}(-[0-9a-f]+)?)?\.parquet$")
TEXT_COLUMNS = ("text", "caption")  # caption columns seen in the wild, in the order tried
KEY_COLUMNS = ("id", "key")


def features(path: str) -> dict | None:
    """The `datasets` features recorded in a Parquet file's schema metadata (None: not written by datasets)."""
    try:
        raw = (parquet_file(path).schema_arrow.metadata or {}).get(b"huggingface")
        return json.loads(raw)["info"]["features"] if raw else None
    except Exception:  # an unreadable file or foreign metadata (pyarrow, the OS, JSON, its shape): not datasets'
        return None


def split_of(path: str) -> str:
    match = SPLIT_NAME.match(Path(path).name)
    return match["split"] if match else Path(path).stem


@register_format
class HfParquet(ParquetFormat):
    name = "hf-parquet"
    label = "Hugging Face datasets Parquet"
    priority = 40
    field_defaults = {**ParquetFormat.field_defaults, "text": "text", "key": "id"}

    @classmethod
    def claim(cls, files: list[str], forced: bool = False) -> Claim | None:
        found = ParquetFormat.claim(files, forced)
        if found is None or not found.shards:
            return None
        local = [p for p in found.shards if is_local(p)]
        feats = features(local[0]) if local else None
        if feats is None and not forced:
            return None
        fields: dict[str, str | None] = {}
        if feats:
            images = [name for name, f in feats.items() if isinstance(f, dict) and f.get("_type") == "Image"]
            texts = [name for name in TEXT_COLUMNS if feats.get(name, {}).get("dtype") == "string"]
            keys = [name for name in KEY_COLUMNS if name in feats]
            if images:
                fields["image"] = images[0]
            if texts:
                fields["text"] = texts[0]
            fields["key"] = keys[0] if keys else "id"
        return Claim(cls.name, found.shards, fields, why="the Parquet schema metadata holds Hugging Face datasets' "
                                                         "features")

    @classmethod
    def directory_files(cls, directory: Path) -> list[str] | None:
        """The hub's layout: the dataset root holds README.md and data/, the files are in data/.
        Every shard file there is listed, so that img2dataset output kept in ROOT/data/ (its tars
        beside their sidecars) is detected as img2dataset's, not its sidecars as the hub's Parquet."""
        data = directory / HUB_DATA_DIR
        if data.is_dir() and not any(p.suffix in (".parquet", ".tar") for p in directory.iterdir() if p.is_file()):
            files = sorted(str(p) for p in data.iterdir() if p.name.endswith(SHARD_SUFFIXES) and p.is_file())
            return files or None
        return None

    @classmethod
    def select_split(cls, shards: list[str], split: str) -> list[str]:
        chosen = [s for s in shards if split_of(s) == split]
        if not chosen:
            splits = sorted({split_of(s) for s in shards})
            raise UserError(f"no file of split {split!r} among the {len(shards)} file(s); splits: {', '.join(splits)}")
        return chosen

    def image_root(self, path: str) -> Path:
        """Relative image paths start at the dataset root: `image_root`, else the folder holding
        `data/` for the hub's layout, else the file's folder."""
        if self.spec.image_root:
            return Path(self.spec.image_root)
        folder = Path(path).parent
        return folder.parent if folder.name == HUB_DATA_DIR else folder

    def describe_extra(self) -> str:
        counts: dict[str, int] = {}
        for shard in dict.fromkeys(self.spec.shards):
            counts[split_of(shard)] = counts.get(split_of(shard), 0) + 1
        splits = ", ".join(f"{name} ({n} file{'s' if n > 1 else ''})" for name, n in counts.items())
        chosen = f"split {self.spec.split}" if self.spec.split else f"all splits: {splits}"
        return f"{chosen}; image paths under {self.image_root(self.spec.shards[0])}"
