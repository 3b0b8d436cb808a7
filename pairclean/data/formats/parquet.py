"""Parquet files: one row per pair, one column per field; a unit is a row group.

Read with the Parquet stages (`data.reading.parquet`). Copies (filter, corrupt) are
`data.rewriting.parquet`.
"""

from __future__ import annotations

from pathlib import Path

from pairclean.data.formats.base import Claim, InputFormat, register_format
from pairclean.data.reading.inputs import parquet_file
from pairclean.data.reading.parquet import parquet_keys, parquet_pairs, positional_key, row_group_rows, row_groups
from pairclean.data.units import Unit
from pairclean.errors import UserError


@register_format
class ParquetFormat(InputFormat):
    name = "parquet"
    label = "Parquet files"
    priority = 90
    suffix = ".parquet"
    field_defaults = {"image": "image", "text": "caption", "json_text_key": None, "text2": "caption2",
                      "image2": "image2", "label": "label", "key": "key"}

    @classmethod
    def claim(cls, files: list[str], forced: bool = False) -> Claim | None:
        parquets = [f for f in files if f.endswith(".parquet")]
        if forced or (parquets and len(parquets) == len(files)):
            return Claim(cls.name, parquets, why="every file is Parquet, without img2dataset's columns or "
                                                 "Hugging Face datasets' metadata")
        return None

    def image_root(self, path: str) -> Path:
        """Where the file's relative image paths start: `image_root`, else the file's folder."""
        return Path(self.spec.image_root) if self.spec.image_root else Path(path).parent

    def read(self, unit: str):
        return parquet_pairs(self.spec, unit, self.image_root(Unit.parse(unit).path), self.field_defaults)

    def units(self) -> list[str]:
        return row_groups(self.spec.shards)

    def describe_key(self) -> str:
        """The key column, or, when the first file has none, the file/row keys the rows then get."""
        key, shards = self.spec.fields.key, self.spec.shards
        try:
            present = not shards or not key or key in parquet_file(shards[0]).schema_arrow.names
        except Exception:  # unreadable: the run says why when it reaches the file
            present = True
        if present:
            return super().describe_key()
        return f"file/row ({positional_key(shards[0], 0)}, {positional_key(shards[0], 1)}, ...: no {key!r} column)"

    def count(self, unit: str) -> int:
        return row_group_rows(unit)

    def rows(self, shard: str) -> tuple[int, str | None]:
        try:
            return parquet_file(shard).metadata.num_rows, None
        except Exception as exc:  # pyarrow, the OS or a remote filesystem: one line naming the shard
            raise UserError(f"cannot read Parquet shard {shard}: {str(exc).splitlines()[0][:200]}") from None

    def keys(self, shard: str) -> list[str]:
        return parquet_keys(self.spec, shard)
