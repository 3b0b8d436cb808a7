"""Parquet files: one row per pair, one column per field; a unit is a row group.

Read with the Parquet stages (`data.reading.parquet`). Copies (filter, corrupt) are
`data.rewriting.parquet`.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from pairclean.data.formats.base import Claim, Found, InputFormat, Need, needs_of, register_format
from pairclean.data.reading.inputs import parquet_file
from pairclean.data.reading.parquet import parquet_keys, parquet_pairs, positional_key, row_group_rows, row_groups
from pairclean.data.spec import DatasetSpec
from pairclean.data.units import Unit
from pairclean.errors import UserError
from pairclean.ops.urls import is_local


def _kind(dtype: pa.DataType) -> str:
    """What a column can hold: image (bytes, or a struct such as Hugging Face's Image), text, other."""
    if pa.types.is_binary(dtype) or pa.types.is_large_binary(dtype) or pa.types.is_struct(dtype):
        return "image"
    return "text" if pa.types.is_string(dtype) or pa.types.is_large_string(dtype) else "other"


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

    def found(self) -> Found | None:
        """The first file's columns and what each can hold (a string column of paths counts as an
        image column for `image_path`)."""
        first = self.spec.shards[0] if self.spec.shards else None
        if first is None or not is_local(first):
            return None
        try:
            schema = parquet_file(first).schema_arrow
        except Exception:  # pyarrow or the OS: the run's unit names the failure when it reads the file
            return None
        return Found(Path(first).name, "column", {f.name: _kind(f.type) for f in schema})

    def reads(self, spec: DatasetSpec) -> list[Need]:
        f = spec.fields
        return needs_of(spec, lambda second: ((f.image2_path or f.image2) if second else (f.image_path or f.image),),
                     lambda value: (value,))

    def count(self, unit: str) -> int:
        return row_group_rows(unit)

    def rows(self, shard: str) -> tuple[int, str | None]:
        try:
            return parquet_file(shard).metadata.num_rows, None
        except Exception as exc:  # pyarrow, the OS or a remote filesystem: one line naming the shard
            raise UserError(f"cannot read Parquet shard {shard}: {str(exc).splitlines()[0][:200]}") from None

    def keys(self, shard: str) -> list[str]:
        return parquet_keys(self.spec, shard)
