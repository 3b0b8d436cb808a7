"""img2dataset output (and DataComp's shards, which img2dataset writes): the layouts as its code writes them.

webdataset output (`NNNNN.tar` + `NNNNN.parquet` + `NNNNN_stats.json`, img2dataset/writer.py):
the tar holds `KEY.jpg`, `KEY.txt`, `KEY.json` for each successful download only; the `.parquet`
beside it is a *sidecar*: one row per input URL of the shard, failures included (`status`
`failed_to_download` / `failed_to_resize`, img2dataset's own `error_message`). Sidecars are not
shards: a failed download becomes an error row with img2dataset's reason (`shard` = the sidecar,
`index` = its row), and filter writes the kept samples' sidecar rows and a stats summary beside
each tar it writes, so the output has the input's shape (and DataComp's resharder, which sizes
shards from `_stats.json`, takes it as input).

parquet output (`NNNNN.parquet` + `NNNNN_stats.json`): one row per input URL, image bytes in
`jpg` (null for failed rows), caption in `caption`, `key`, `status`, `error_message`.

DataComp's shards are img2dataset webdataset output whose json members and sidecars carry
DataComp's `uid`: rows are keyed by it, so scores made from DataComp's shipped embeddings join.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pairclean.data.formats.base import Claim, KeptRows, NextCaption, register_format
from pairclean.data.formats.parquet import ParquetFormat
from pairclean.data.formats.webdataset import WebDatasetFormat, is_tar
from pairclean.data.reader import RawPair, Sample, UnitFailure, parquet_file, read_parquet_pairs, sample_key, shown
from pairclean.data.units import Unit
from pairclean.errors import UserError
from pairclean.ops.atomic import write_json
from pairclean.ops.urls import is_local

SUCCESS = "success"
STATUS_COLUMNS = ("status", "error_message")


def failure_reason(status, message) -> str | None:
    """img2dataset's own words for a row it could not download or resize (None: a success)."""
    if status in (None, SUCCESS):
        return None
    return f"img2dataset {status}: {shown(message)}" if message else f"img2dataset {status}"


def stats_path(data_file: Path) -> Path:
    """`00000.tar` / `00000.parquet` -> `00000_stats.json`."""
    return data_file.with_name(data_file.name.split(".")[0] + "_stats.json")


def write_stats(data_file: Path, table: pa.Table | None, count: int) -> None:
    """img2dataset's per-shard stats for a shard pairclean wrote (DataComp's resharder reads `successes`)."""
    statuses = table.column("status").to_pylist() if table is not None and "status" in table.column_names \
        else [SUCCESS] * count
    by_status: dict[str, int] = {}
    for status in statuses:
        by_status[str(status)] = by_status.get(str(status), 0) + 1
    write_json(stats_path(data_file), {"count": len(statuses), "successes": by_status.get(SUCCESS, 0),
                                       "failed_to_download": by_status.get("failed_to_download", 0),
                                       "failed_to_resize": by_status.get("failed_to_resize", 0),
                                       "status_dict": by_status, "written_by": "pairclean"})


def _sidecar_name(tar: str) -> str:
    return tar[: -len(".tar")] + ".parquet" if tar.endswith(".tar") else tar + ".parquet"


SIDECARS_TRIED = 8  # detection reads the columns of the first readable of this many sidecars


def _columns(path: str) -> set[str]:
    try:
        return set(parquet_file(path).schema_arrow.names)
    except Exception:
        return set()


def _table(path: str, columns: list[str] | None = None) -> pa.Table:
    """A sidecar (or img2dataset Parquet file) read whole, or a UserError naming it."""
    try:
        return parquet_file(path).read(columns=columns)
    except Exception as exc:
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
        columns = next((found for found in map(_columns, local[:SIDECARS_TRIED]) if found), None)
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
        table = _table(sidecar, [c for c in (self.sidecar_key(), *STATUS_COLUMNS) if c in _columns(sidecar)])
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
        except Exception:
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

    # -- filter: per-shard sidecars and stats beside each tar written ------------------------

    def write_kept(self, kept: KeptRows, tmp: Path, prefix: str, shard_size: int, shard_bytes: float, progress):
        # The sidecar row of each sample handed to the writer, in order (None: the sidecar has no row
        # for it); a closed shard takes as many as it holds: the writer closes a shard when the next
        # sample arrives, so the last one handed over may belong to the next shard.
        self._rows: list[pa.Table | None] = []
        self._index: tuple[str | None, dict[str, int], pa.Table | None] = (None, {}, None)
        return super().write_kept(kept, tmp, prefix, shard_size, shard_bytes, progress)

    def on_kept(self, shard: str, sample: Sample) -> None:
        if self._index[0] != shard:
            sidecar = self.sidecar(shard)
            table = _table(sidecar) if sidecar is not None else None
            column = self.sidecar_key()
            rows = {str(k): i for i, k in enumerate(table.column(column).to_pylist())} \
                if table is not None and column in table.column_names else {}
            self._index = (shard, rows, table)
        _, rows, table = self._index
        row = rows.get(sample_key(self.spec.fields.key, sample))
        self._rows.append(table.slice(row, 1) if row is not None else None)

    def on_closed(self, path: Path) -> None:
        count = self.count(str(path))
        mine, self._rows = [t for t in self._rows[:count] if t is not None], self._rows[count:]
        table = pa.concat_tables(mine, promote_options="default") if mine else None
        if table is not None:
            pq.write_table(table, path.with_suffix(".parquet"))
        write_stats(path, table, count)

    # -- corrupt: the sidecar copied with the changed captions -------------------------------

    def rewrite(self, shard: str, tmp: Path, next_caption: NextCaption, caption_field: str) -> None:
        changed: dict[str, str] = {}

        def recording(path: str, index: int, key: str | None) -> str | None:
            new = next_caption(path, index, key)
            if new is not None:
                changed[str(key)] = new
            return new

        super().rewrite(shard, tmp, recording, caption_field)
        sidecar = self.sidecar(shard)
        target = tmp / self.output_name(shard)
        if sidecar is None:
            return
        table = _table(sidecar)
        column = self.sidecar_key()
        if changed and "caption" in table.column_names and column in table.column_names:
            keys = [str(k) for k in table.column(column).to_pylist()]
            captions = [changed.get(k, c) for k, c in zip(keys, table.column("caption").to_pylist())]
            index = table.schema.get_field_index("caption")
            table = table.set_column(index, table.schema.field(index), pa.array(captions, pa.string()))
        pq.write_table(table, target.with_suffix(".parquet"))
        stats = stats_path(Path(shard))
        if stats.is_file():
            stats_path(target).write_bytes(stats.read_bytes())


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
            if not local or not {"jpg", "caption", "key", *STATUS_COLUMNS} <= _columns(local[0]):
                return None
        return Claim(cls.name, found.shards, why="the Parquet files have img2dataset's columns (jpg, caption, key, "
                                                 "status, error_message)")

    def read(self, unit: str):
        return read_parquet_pairs(self.spec, unit, self.image_root(Unit.parse(unit).path), extra=STATUS_COLUMNS,
                                  row_error=lambda row: failure_reason(row.get("status"), row.get("error_message")))

    def describe_extra(self) -> str:
        failed = unreadable = 0
        for shard in dict.fromkeys(self.spec.shards):
            try:
                if is_local(shard) and "status" in _columns(shard):
                    status = _table(shard, ["status"]).column("status")
                    failed += len(status) - pc.sum(pc.equal(status, SUCCESS)).as_py() if len(status) else 0
            except UserError:
                unreadable += 1
        broken = f"; {unreadable} file(s) cannot be read: their units fail" if unreadable else ""
        return f"{failed} failed download(s) become error rows with img2dataset's reason{broken}"

    def on_written(self, target: Path, rows: int) -> None:
        write_stats(target, parquet_file(str(target)).read(columns=["status"])
                    if "status" in _columns(str(target)) else None, rows)

    def rewrite(self, shard: str, tmp: Path, next_caption: NextCaption, caption_field: str) -> None:
        super().rewrite(shard, tmp, next_caption, caption_field)
        stats = stats_path(Path(shard))
        if stats.is_file():
            stats_path(tmp / self.output_name(shard)).write_bytes(stats.read_bytes())
