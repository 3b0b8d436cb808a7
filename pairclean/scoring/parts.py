"""The score sink: one Parquet part per unit plus a JSON commit record, both written atomically.

The commit record is the truth: a part without one is redone on resume, so a killed run loses
and duplicates nothing. The parts directory also pins the run's settings, its unit list and its
beta, so that a resumed run cannot silently mix scores computed under different settings, and
holds a lock so that two processes never write the same run.

    <out>.parts/settings.json   what a resumed run must share (written last when a run starts)
    <out>.parts/units.json      the run's units, in output order
    <out>.parts/run.json        run id; whether the run replaces an existing output (--overwrite)
    <out>.parts/beta.json       beta, computed once
    <out>.parts/groups.json     the packing: units in groups whose pairs share batches (pinned at start)
    <out>.parts/claims/N.json   who is scoring group N (created exclusively; cleared when a run starts)
    <out>.parts/part-*.parquet + part-*.done.json   one part + commit record per unit
                                (a part's `null_sim` column holds the run's null sample: see finalize)
    <out>.parts/lock            locked (lockf) by the live run
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pairclean.core.beta import BetaEstimate
from pairclean.ops.atomic import atomic_path, remove_stale_temps, write_json
from pairclean.ops.records import Problem, Record, RecordError, convert
from pairclean.errors import ConfigError, UserError
from pairclean.ops.faults import fault_point
from pairclean.data.units import unit_shard
from pairclean.scores.contract import run_identity

PART_SCHEMA = pa.schema([
    ("key", pa.string()),
    ("shard", pa.string()),
    ("index", pa.int64()),
    ("sim", pa.float32()),
    ("null_sim", pa.float32()),  # the row's left with another row's right (core.scorer.null_partners); null where not drawn
    ("error", pa.string()),
])
UNIT_KEYS = ("units_sha1", "n_units")  # settings that describe the unit list (compared separately)
NON_FINITE = "no finite similarity"  # NaN/inf from the estimator, or a row it never scored
MAX_ERROR_CHARS = 300  # an error row's reason is cut here: one line, never a dump of the row's data
_HELD: dict[str, int] = {}  # parts directories whose run lock this process holds -> descriptor


def parts_dir_for(out: Path) -> Path:
    return out.with_name(out.name + ".parts")


def settings_digest(settings: dict) -> str:
    """Identity of a run's settings, stored in the output's provenance."""
    return hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def _canonical(obj) -> dict:
    return json.loads(json.dumps(obj, default=str))


def _is_record(record) -> bool:
    """A commit record as `PartStore.commit` writes it: its unit and its row counts."""
    counts = [record.get(k) for k in ("rows", "errors")] if isinstance(record, dict) else [None]
    return isinstance(record.get("unit") if isinstance(record, dict) else None, str) and all(
        isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts)


@dataclass(frozen=True)
class GroupClaims:
    """Work claiming through the shared parts directory, no server: the process (rank or DataLoader
    worker, on any node that sees the directory) that creates `claims/N.json` first scores group N.
    The create is exclusive (O_EXCL, atomic on local filesystems and NFSv3+), so a group is
    scored by one process however many race for it; a process that dies leaves its claim, and
    the next run, which clears every claim once it holds the run lock, scores the group again."""

    dir: Path

    def claim(self, group: int) -> bool:
        try:
            fd = os.open(self.dir / f"{group}.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as fh:
            json.dump({"rank": int(os.environ.get("RANK", "0")), "pid": os.getpid(), "host": socket.gethostname(),
                       "time": time.time()}, fh)
        return True

    def holders(self) -> dict[int, dict]:
        """The claims on disk, by group (unreadable ones, being written, as {})."""
        found = {}
        for path in self.dir.glob("*.json"):
            try:
                found[int(path.stem)] = json.loads(path.read_text())
            except (OSError, ValueError):
                found[int(path.stem)] = {}
        return found


@dataclass(frozen=True)
class RunInfo(Record):
    """run.json: the run's id (stored in its output's provenance) and whether it replaces an output."""

    what = "run record"
    run_id: str
    replaces_output: bool
    started_at: str | None = None


@dataclass
class RunStart:
    """What `PartStore.begin` decided: a fresh or a resumed run, and its units in output order."""

    resumed: bool
    units: list[str]


def float32_values(column) -> np.ndarray:
    """A column of floats (an array, or a list holding None) as float32, None as NaN. Not through
    pyarrow's `from_pandas`, which imports pandas: 1.7 s of the first commit's CPU, measured."""
    if isinstance(column, np.ndarray):
        return column.astype(np.float32, copy=False)
    return np.array([np.nan if v is None else v for v in column], dtype=np.float32)


class PartStore:
    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self._lock_fd: int | None = None
        self._lock_key = ""

    @staticmethod
    def _stem(unit: str) -> str:
        return "part-" + hashlib.sha1(unit.encode()).hexdigest()[:20]

    def part_path(self, unit: str) -> Path:
        return self.dir / f"{self._stem(unit)}.parquet"

    def record_path(self, unit: str) -> Path:
        return self.dir / f"{self._stem(unit)}.done.json"

    def committed(self) -> dict[str, dict]:
        """Commit records of finished units, keyed by unit (only those whose part file exists)."""
        records = {}
        if not self.dir.is_dir():
            return records
        for path in self.dir.glob("part-*.done.json"):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # an unreadable record means the unit is redone
            if not _is_record(record) or path != self.record_path(record["unit"]):
                continue  # so does one that is not a commit record of its own unit
            if self.part_path(record["unit"]).is_file():
                records[record["unit"]] = record
        return records

    def commit(self, unit: str, columns: dict, record: dict) -> None:
        """Write the unit's part, then its commit record. Row and error counts are taken from the
        rows themselves; a row without a finite similarity and without an error reason becomes
        an error row (it could be neither scored nor weighted). Columns: lists or arrays."""
        values = float32_values(columns["sim"])
        bad = ~np.isfinite(values)  # NaN, inf, and None
        error = pc.utf8_slice_codeunits(pa.array(columns["error"], type=pa.string()), 0, MAX_ERROR_CHARS)
        unexplained = pa.array(bad & ~error.is_valid().to_numpy(zero_copy_only=False))
        null = columns.get("null_sim")
        null = float32_values(null) if null is not None else np.full(len(values), np.nan, dtype=np.float32)
        null = pa.array(null, type=pa.float32(), mask=~np.isfinite(null))
        table = pa.table({"key": columns["key"], "shard": columns["shard"], "index": columns["index"],
                          "sim": pa.array(values, type=pa.float32(), mask=bad), "null_sim": null,
                          "error": pc.if_else(unexplained, pa.scalar(NON_FINITE), error)}, schema=PART_SCHEMA)
        n_errors = table.num_rows - table.column("error").null_count
        self.commit_table(unit, table, {**record, "errors": n_errors, "null_rows": table.num_rows - null.null_count},
                          use_dictionary=["shard", "error"])  # keys are unique: no dictionary

    def commit_table(self, unit: str, table: pa.Table, record: dict, **write_options) -> None:
        """Write any part (a table of rows) and then its commit record (`rows` added, and `errors`
        0 unless the record counts error rows): the commit protocol of every run that keeps parts
        here (scoring's scores, dedup's assignments and clusters)."""
        with atomic_path(self.part_path(unit), temp_dir=self.dir) as tmp:
            pq.write_table(table, tmp, **write_options)
        fault_point("part-written")
        write_json(self.record_path(unit), {"errors": 0, **record, "unit": unit, "rows": table.num_rows},
                   temp_dir=self.dir)
        fault_point("committed")

    def error_counts(self, units: list[str], top: int = 5) -> list[dict]:
        """The commonest error reasons of the committed parts, most frequent first."""
        counts: dict[str, int] = {}
        for unit in units:
            column = pq.read_table(self.part_path(unit), columns=["error"]).column("error")
            for item in pc.value_counts(pc.drop_null(column.combine_chunks())).to_pylist():
                counts[item["values"]] = counts.get(item["values"], 0) + item["counts"]
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
        return [{"error": reason, "rows": n} for reason, n in ranked]

    def common_errors(self, units: list[str]) -> str:
        """The commonest error reasons as one line: `12 x 'missing image'; 4 x '...'`."""
        return "; ".join(f"{c['rows']:,} x {c['error']!r}" for c in self.error_counts(units, top=2))

    # -- starting, resuming, finishing ------------------------------------------------------

    def _lock(self) -> None:
        """Hold an exclusive lock on the run for the life of this process.

        A POSIX record lock (lockf): it belongs to the process, so it is released when the
        process dies however it dies (a SIGKILLed run never blocks its own resume), DataLoader
        workers forked from it do not inherit it, and it works over NFS. One descriptor per
        directory per process (closing any descriptor of the file drops a POSIX lock), so a
        retry in the same process after an exception takes the lock over.
        """
        if self._lock_fd is not None:
            return
        key = str(self.dir.resolve())
        fd = _HELD.get(key)
        if fd is None:
            fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise UserError(f"another pairclean process is writing {self.dir}; wait for it or stop it first") from None
            _HELD[key] = fd
        self._lock_fd, self._lock_key = fd, key

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            _HELD.pop(self._lock_key, None)
            os.close(self._lock_fd)
            self._lock_fd = None

    def _clear(self) -> None:
        """Empty the directory except the lock file we hold."""
        for entry in self.dir.iterdir():
            if entry.name == "lock":
                continue
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()

    def _read(self, name: str, kind: type | None = None) -> dict | list | None:
        """A run file as JSON (None when absent); `kind`: the type it must be."""
        path = self.dir / name
        try:
            value = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path} is unreadable ({exc}); pass `overwrite` to start the run over", "overwrite") from None
        if kind is not None and not isinstance(value, kind):
            raise self._invalid(name, f"a JSON {type(value).__name__}, not a {kind.__name__}")
        return value

    def _record(self, name: str, read):
        """A run file read as a record (`read(json)`), or None when absent; a file that is not the
        record is `_invalid`, named with the field."""
        value = self._read(name, dict)
        if value is None:
            return None
        try:
            return read(value)
        except RecordError as exc:
            raise self._invalid(name, f"{exc.field}: {exc.problem}" if exc.field else exc.problem) from None

    def _invalid(self, name: str, why: str) -> ConfigError:
        """The one error for resume state that does not describe a run: it is never trusted, never repaired."""
        return ConfigError(f"{self.dir / name} is not a valid record of the unfinished run ({why}); "
                           "pass `overwrite` to start the run over", "overwrite")

    def _start(self, settings: dict, units: list[str], replaces_output: bool) -> RunStart:
        self._clear()
        write_json(self.dir / "units.json", units, temp_dir=self.dir)
        write_json(self.dir / "run.json", RunInfo(uuid.uuid4().hex, replaces_output,
                                                  time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())).to_json(),
                   temp_dir=self.dir)
        write_json(self.dir / "settings.json", settings, temp_dir=self.dir)  # last: marks a usable run
        return RunStart(resumed=False, units=units)

    def _resume(self, settings: dict, units: list[str], earlier: dict) -> RunStart:
        """Continue the run in this directory: same settings, same units (shards that vanished
        since it started become failed units; new shards are refused)."""
        current = _canonical(settings)
        differ = sorted(k for k in set(earlier) | set(current)
                        if k not in UNIT_KEYS and earlier.get(k) != current.get(k))
        if differ:
            shown = "; ".join(f"{k}: {earlier.get(k)!r} -> {current.get(k)!r}" for k in differ)
            raise ConfigError(f"{self.dir} holds an unfinished run with different settings ({shown}); "
                            "re-run with the same settings to resume, or pass `overwrite` to start over", "overwrite")
        pinned = self._read("units.json", list)
        if pinned is not None and (not all(isinstance(u, str) for u in pinned) or len(set(pinned)) != len(pinned)):
            raise self._invalid("units.json", "not a list of distinct units")
        if pinned is None:
            raise ConfigError(f"{self.dir} has no units.json; pass `overwrite` to start the run over", "overwrite")
        if pinned != units:
            listed, known = set(units), set(pinned)
            added = [u for u in units if u not in known]
            dropped = [u for u in pinned if u not in listed and os.path.exists(unit_shard(u))]
            if added or dropped:  # the user changed the inputs (a vanished shard is only a failed unit)
                detail = "; ".join(([f"{len(added)} new (first: {added[0]})"] if added else []) +
                                   ([f"{len(dropped)} no longer listed (first: {dropped[0]})"] if dropped else []))
                raise ConfigError(f"the input shards differ from the unfinished run in {self.dir} ({detail}); "
                                "re-run with the same inputs to resume, or pass `overwrite` to start over", "overwrite")
        return RunStart(resumed=True, units=pinned)

    def finished(self, out: Path, settings: dict, overwrite: bool = False, resume: bool = False) -> bool:
        """Whether `out` is already the complete result of a run with these settings (nothing left
        to do; the caller reads its summary); call it before loading a model, so that what `begin`
        would refuse is refused at once. A parts directory that a kill between the output's
        rename and the cleanup left behind is removed here."""
        if overwrite and resume:
            raise ConfigError("resume and overwrite contradict each other: overwrite discards the unfinished run", "resume", "overwrite")
        if overwrite:
            return False
        unfinished = (self.dir / "settings.json").is_file()
        if not out.exists():
            if resume and not unfinished:
                raise UserError(f"nothing to resume: there is no unfinished run for {out} ({self.dir} not found)")
            return False
        run_id, digest = run_identity(out)  # (None, None): not a pairclean output
        if self.dir.is_dir():
            self._lock()
            run = self.run_info() if unfinished else None
            if run is not None and run_id != run.run_id:
                self._unlock()
                if run.replaces_output:
                    return False  # a killed --overwrite run: begin() resumes it
                raise ConfigError(f"{out} exists; pass `overwrite` to replace it", "overwrite")
            self.remove()  # the finished run's leftover (or a run killed before it got going)
        if digest is not None and digest == settings_digest(settings):
            return True
        detail = " (a finished run with other settings)" if digest is not None else ""
        raise ConfigError(f"{out} exists{detail}; pass `overwrite` to replace it", "overwrite")

    def begin(self, out: Path, settings: dict, units: list[str], overwrite: bool = False,
              resume: bool = False) -> RunStart:
        """Start a run or resume the unfinished one (call `finished` first).

        Re-running the same command always continues where it stopped; `resume=True` insists
        that there is something to continue; `overwrite=True` discards any earlier output and
        unfinished run. A complete output is never replaced without `overwrite`.
        """
        if overwrite and resume:
            raise ConfigError("resume and overwrite contradict each other: overwrite discards the unfinished run", "resume", "overwrite")
        existed = self.dir.is_dir()
        if existed:
            self._lock()
        try:
            if overwrite:  # the unfinished run is discarded unread
                self.dir.mkdir(parents=True, exist_ok=True)
                self._lock()
                return self._start(settings, units, replaces_output=out.exists())
            earlier = self._read("settings.json", dict) if existed else None
            run = self.run_info() if earlier is not None else None
            if out.exists():
                if run is not None and run.replaces_output:
                    return self._resume(settings, units, earlier)  # an --overwrite run, killed: carry on
                raise ConfigError(f"{out} exists; pass `overwrite` to replace it", "overwrite")
            if earlier is not None:
                return self._resume(settings, units, earlier)
            if resume:
                raise UserError(f"nothing to resume: there is no unfinished run for {out} ({self.dir} not found)")
            self.dir.mkdir(parents=True, exist_ok=True)
            self._lock()
            return self._start(settings, units, replaces_output=False)
        except UserError:
            # Only a directory this process created and locked is its own to remove: a process
            # that lost the race to create it must leave the winner's run alone.
            if not existed and self._lock_fd is not None and self.dir.is_dir():
                self.remove()
            else:
                self._unlock()
            raise
        finally:
            if self._lock_fd is not None:
                remove_stale_temps(self.dir)

    def run_info(self) -> RunInfo | None:
        """run.json: the run id (stored in the output's provenance) and whether it replaces an output."""
        return self._record("run.json", lambda value: RunInfo.from_json(value, self.dir / "run.json"))

    def settings_sha1(self) -> str | None:
        settings = self._read("settings.json")
        return settings_digest(settings) if settings is not None else None

    def load_groups(self, units: list[str]) -> list[list[str]] | None:
        """The pinned packing (None before it is saved), checked against the run's own units: every
        unit in exactly one group, no other unit, every group a non-empty list of units."""
        groups = self._read("groups.json", list)
        if groups is None:
            return None
        if not all(isinstance(g, list) and g and all(isinstance(u, str) for u in g) for g in groups):
            raise self._invalid("groups.json", "not a list of non-empty lists of units")
        packed = [u for g in groups for u in g]
        missing, foreign = set(units) - set(packed), set(packed) - set(units)
        if missing or foreign or len(packed) != len(units):
            why = "; ".join([f"{len(missing)} unit(s) in no group"] * bool(missing)
                            + [f"{len(foreign)} unit(s) not of this run"] * bool(foreign)
                            + ["a unit in two groups"] * (not missing and not foreign))
            raise self._invalid("groups.json", why)
        return groups

    def save_groups(self, groups: list[list[str]]) -> None:
        write_json(self.dir / "groups.json", groups, temp_dir=self.dir)

    def fresh_claims(self) -> GroupClaims:
        """The claims of this run, with those of earlier (dead) runs cleared: call with the run lock held."""
        claims = self.dir / "claims"
        if claims.is_symlink() or (claims.exists() and not claims.is_dir()):
            raise self._invalid("claims", "not a directory")
        shutil.rmtree(claims, ignore_errors=True)
        claims.mkdir()
        return GroupClaims(claims)

    def load_beta(self) -> tuple[BetaEstimate, str] | None:
        """beta as saved when the run started, and where it came from (None before), read as strictly
        as a flag (`core.beta.BetaEstimate`'s fields and `source`)."""
        def read(value: dict) -> tuple[BetaEstimate, str]:
            source = value.get("source", "resumed")
            if not isinstance(source, str):
                raise RecordError(self.dir / "beta.json", "saved beta", "source", "must be a string")
            try:
                return convert({k: v for k, v in value.items() if k != "source"}, BetaEstimate), source
            except Problem as problem:
                raise RecordError(self.dir / "beta.json", "saved beta", problem.field, problem.problem) from None

        return self._record("beta.json", read)

    def save_beta(self, beta: BetaEstimate, source: str) -> None:
        write_json(self.dir / "beta.json", {**beta.as_dict(), "source": source}, temp_dir=self.dir)

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self._unlock()
