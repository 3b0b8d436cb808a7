"""img2dataset output (and DataComp's shards, which img2dataset writes): the layouts as its code writes them.

webdataset output (`NNNNN.tar` + `NNNNN.parquet` + `NNNNN_stats.json`, img2dataset/writer.py):
the tar holds `KEY.jpg`, `KEY.txt`, `KEY.json` for each successful download only; the `.parquet`
beside it is a *sidecar*: one row per input URL of the shard, failures included (`status`
`failed_to_download` / `failed_to_resize`, img2dataset's own `error_message`). Sidecars are not
shards: a failed download becomes an error row with img2dataset's reason (`shard` = the sidecar,
`index` = its row). Filter writes the kept samples' sidecar rows and a stats summary beside each
tar it writes (`data.rewriting.img2dataset`), so the output has the input's shape (and DataComp's
resharder, which sizes shards from `_stats.json`, takes it as input).

parquet output (`NNNNN.parquet` + `NNNNN_stats.json`): one row per input URL, image bytes in
`jpg` (null for failed rows), caption in `caption`, `key`, `status`, `error_message`.

DataComp's shards are img2dataset webdataset output whose json members and sidecars carry
DataComp's `uid`: rows are keyed by it, so scores made from DataComp's shipped embeddings join.
"""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.compute as pc

from pairclean.data.formats.base import Claim, register_format
from pairclean.data.formats.parquet import ParquetFormat
from pairclean.data.formats.webdataset import WebDatasetFormat, is_tar
from pairclean.data.reading.inputs import parquet_file
from pairclean.data.reading.parquet import parquet_pairs
from pairclean.data.reading.values import shown
from pairclean.data.spec import RawPair, UnitFailure
from pairclean.data.units import Unit
from pairclean.errors import UserError
from pairclean.ops.urls import is_local

SUCCESS = "success"
STATUS_COLUMNS = ("status", "error_message")


def failure_reason(status, message) -> str | None:
    """img2dataset's own words for a row it could not download or resize (None: a success)."""
    if status in (None, SUCCESS):
        return None
    return f"img2dataset {status}: {shown(message)}" if message else f"img2dataset {status}"


def _sidecar_name(tar: str) -> str:
    return tar[: -len(".tar")] + ".parquet" if tar.endswith(".tar") else tar + ".parquet"


SIDECARS_TRIED = 8  # detection reads the columns of the first readable of this many sidecars


def columns_of(path: str) -> set[str]:
    """A Parquet file's column names (none when it cannot be read: detection then passes it by)."""
    try:
        return set(parquet_file(path).schema_arrow.names)
    except Exception:  # pyarrow, the OS or a remote filesystem: not this layout's sidecar
        return set()


def read_table(path: str, columns: list[str] | None = None) -> pa.Table:
    """A sidecar (or img2dataset Parquet file) read whole, or a UserError naming it."""
    try:
        return parquet_file(path).read(columns=columns)
    except Exception as exc:  # pyarrow, the OS or a remote filesystem: one line naming the file
        raise UserError(f"cannot read {path}: {str(exc).splitlines()[0][:300]}") from None


@register_format
class Img2DatasetWebDataset(WebDatasetFormat):
    name = "img2dataset-webdataset"
    label = "img2dataset webdataset output"
    priority = 20
    needs: tuple[str, ...] = ("key", "status")  # sidecar columns that mark the layout

    @classmethod
    def claim(cls, files: list[str], forced: bool = False) -> Claim | None:
        tars = [f for f in files if is_tar(f)]
        parquets = [f for f in files if f.endswith(".parquet")]
        if forced:
            return Claim(cls.name, tars)
        if not tars or len(tars) + len(parquets) != len(files) or not set(parquets) <= {_sidecar_name(t) for t in tars}:
            return None  # no tars, or a Parquet file that is not a tar's sidecar
        # The sidecars named with the tars (a directory), else those beside them on disk (a glob of the tars).
        sidecars = parquets or [s for t in tars if is_local(t) and os.path.isfile(s := _sidecar_name(t))]
        local = [p for p in sidecars if is_local(p)]
        if not sidecars:
            return None
        why = f"each tar has img2dataset's sidecar beside it (NNNNN.parquet with {', '.join(cls.needs)})"
        columns = next((found for found in map(columns_of, local[:SIDECARS_TRIED]) if found), None)
        if local and columns is None:  # no sidecar readable: their names alone say img2dataset's
            return Claim(cls.name, tars, why=why + "; no sidecar could be read") if "uid" not in cls.needs else None
        if local and not set(cls.needs) <= columns:
            return None
        return Claim(cls.name, tars, why=why)

    def sidecar(self, shard: str) -> str | None:
        path = _sidecar_name(shard)
        return path if not is_local(path) or os.path.isfile(path) else None

    def metadata_files(self) -> list[str]:
        return [s for s in (self.sidecar(t) for t in dict.fromkeys(self.spec.shards)) if s is not None]

    def sidecar_key(self) -> str:
        """The sidecar column that holds a sample's key (img2dataset's `key`, or the json key read)."""
        key = self.spec.fields.key
        return "key" if key in (None, "__key__") else key

    def _failed(self, shard: str) -> tuple[str | None, list[tuple[int, str, str]]]:
        """(the sidecar, its failed rows as (row, key, reason)); the sidecar is None when there is none."""
        sidecar = self.sidecar(shard)
        if sidecar is None:
            return None, []
        table = read_table(sidecar, [c for c in (self.sidecar_key(), *STATUS_COLUMNS) if c in columns_of(sidecar)])
        keys = table.column(self.sidecar_key()).to_pylist() if self.sidecar_key() in table.column_names \
            else [None] * table.num_rows
        status = table.column("status").to_pylist() if "status" in table.column_names else [SUCCESS] * table.num_rows
        message = table.column("error_message").to_pylist() if "error_message" in table.column_names \
            else [None] * table.num_rows
        return sidecar, [(i, str(k), reason) for i, (k, s, m) in enumerate(zip(keys, status, message))
                         if (reason := failure_reason(s, m))]

    def read(self, unit: str):
        yield from super().read(unit)
        try:
            sidecar, failed = self._failed(unit)
        except Exception as exc:  # any way a sidecar breaks: the tar's rows are kept, the unit is a failed unit
            yield UnitFailure(unit, f"img2dataset sidecar: {str(exc).splitlines()[0][:300]}")
            return
        for row, key, reason in failed:
            yield RawPair(key=key, shard=sidecar, index=row, error=reason)

    def count(self, unit: str) -> int:
        try:
            failed = len(self._failed(unit)[1])
        except Exception:  # an unreadable sidecar: its rows are not counted (the unit's read reports it)
            failed = 0
        return super().count(unit) + failed

    def describe_extra(self) -> str:
        sidecars = self.metadata_files()
        failed = unreadable = 0
        for tar in dict.fromkeys(self.spec.shards) if sidecars else ():
            try:
                failed += len(self._failed(tar)[1])
            except UserError:
                unreadable += 1
        broken = f"; {unreadable} cannot be read: their shards are failed units" if unreadable else ""
        return (f"{len(sidecars)} metadata sidecar(s) ({failed} failed download(s) become error rows "
                f"with img2dataset's reason{broken})")


@register_format
class DataCompShards(Img2DatasetWebDataset):
    name = "datacomp-shards"
    label = "DataComp shards (img2dataset webdataset output)"
    priority = 10
    needs = ("uid", "key", "status")
    field_defaults = {**WebDatasetFormat.field_defaults, "key": "uid"}


@register_format
class Img2DatasetParquet(ParquetFormat):
    name = "img2dataset-parquet"
    label = "img2dataset Parquet output"
    priority = 30
    field_defaults = {**ParquetFormat.field_defaults, "image": "jpg", "text": "caption", "key": "key"}

    @classmethod
    def claim(cls, files: list[str], forced: bool = False) -> Claim | None:
        found = ParquetFormat.claim(files, forced)
        if found is None:
            return None
        if not forced:
            local = [p for p in found.shards if is_local(p)]
            if not local or not {"jpg", "caption", "key", *STATUS_COLUMNS} <= columns_of(local[0]):
                return None
        return Claim(cls.name, found.shards, why="the Parquet files have img2dataset's columns (jpg, caption, key, "
                                                 "status, error_message)")

    def read(self, unit: str):
        return parquet_pairs(self.spec, unit, self.image_root(Unit.parse(unit).path), self.field_defaults,
                             extra=STATUS_COLUMNS,
                             row_error=lambda row: failure_reason(row.get("status"), row.get("error_message")))

    def describe_extra(self) -> str:
        failed = unreadable = 0
        for shard in dict.fromkeys(self.spec.shards):
            try:
                if is_local(shard) and "status" in columns_of(shard):
                    status = read_table(shard, ["status"]).column("status")
                    failed += len(status) - pc.sum(pc.equal(status, SUCCESS)).as_py() if len(status) else 0
            except UserError:
                unreadable += 1
        broken = f"; {unreadable} file(s) cannot be read: their units fail" if unreadable else ""
        return f"{failed} failed download(s) become error rows with img2dataset's reason{broken}"
