"""The part store: one Parquet part per unit plus a JSON commit record, both written atomically,
in a parts directory beside the run's output.

The commit record is the truth: a part without one is redone on resume, so a killed run loses
and duplicates nothing. The parts directory also pins the run's settings and its unit list, so
that a resumed run cannot silently mix results computed under different settings, and holds a
lock so that two processes never write the same run. Its owner keeps its own records beside them
(`read_record` / `write_record`: scoring's beta and packing, dedup's k-means and index).

    <out>.parts/settings.json   what a resumed run must share (written last when a run starts)
    <out>.parts/units.json      the run's units, in output order
    <out>.parts/run.json        run id; whether the run replaces an existing output (overwrite)
    <out>.parts/claims/N.json   who does item N (created exclusively; cleared when a run starts)
    <out>.parts/part-*.parquet + part-*.done.json   one part + commit record per unit
    <out>.parts/lock            locked (lockf) by the live run (on disk)

The parts directory lies where the output does: on disk, or on an object store
(`ops.places.RemotePath`: `score --out s3://...`). There an object appears whole or not at all, so a
part is uploaded whole and then its commit record; there is no lock (one driver per output: the
Ray driver, or rank 0, hands out the work) and claims stay on the machine that makes them.
Whatever a commit record says is checked against its part when a run resumes (the part's footer:
its unit and its row count): a part truncated, replaced or miscounted since is scored again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq

from pairclean.errors import ConfigError, UserError
from pairclean.ops.atomic import atomic_path, remove_stale_temps, write_json
from pairclean.ops.faults import fault_point
from pairclean.ops.notices import notice
from pairclean.ops.places import RemotePath
from pairclean.ops.records import JsonObject, Keyed, Record, RecordError
from pairclean.ops.urls import is_local
from pairclean.runs.claims import GroupClaims

NODE_ENV = "PAIRCLEAN_NODE"  # set in a Ray worker: the node its commits name
UNIT_METADATA = b"pairclean.unit"  # a part's footer names its unit: a part copied over another unit's is caught
FOOTER_READERS = 16  # parts whose footers a resumed run reads at once
UNIT_KEYS = ("units_sha1", "n_units")  # settings that describe the unit list (compared separately)
_HELD: dict[str, int] = {}  # parts directories whose run lock this process holds -> descriptor


def parts_dir_for(out: Path | RemotePath) -> Path | RemotePath:
    return out.with_name(out.name + ".parts")


def settings_digest(settings: dict) -> str:
    """Identity of a run's settings, stored in the output's provenance."""
    return hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def units_settings(units: list[str]) -> JsonObject:
    """What pins a run's unit list: its digest and its length."""
    return {"units_sha1": hashlib.sha1(json.dumps(units).encode()).hexdigest(), "n_units": len(units)}


def _canonical(obj) -> JsonObject:
    return json.loads(json.dumps(obj, default=str))


def settings_changes(earlier: dict, current: dict, ignore: tuple[str, ...] = ()) -> list[tuple[str, object, object]]:
    """(name, earlier value, current value) of every setting a resumed run would change, compared
    as JSON stores them (a tuple is a list): what refuses a resume (scoring, dedup, training)."""
    earlier, current = _canonical(earlier), _canonical(current)
    return [(k, earlier.get(k), current.get(k)) for k in sorted(set(earlier) | set(current))
            if k not in ignore and earlier.get(k) != current.get(k)]


def file_fingerprint(path: str) -> dict | None:
    """Size and mtime of a local file, recorded when a unit of it is committed: a file rewritten
    after that is caught on resume instead of keeping stale rows. None for URLs and missing files."""
    if not is_local(path):
        return None
    try:
        info = os.stat(path)
    except OSError:
        return None
    return {"size": info.st_size, "mtime_ns": info.st_mtime_ns}


@dataclass(frozen=True)
class CommitRecord(Record):
    """part-*.done.json, written after its part: the unit is done, with these rows (`errors` of
    them error rows), by this torchrun rank or Ray node, from a file of this fingerprint. A run's
    owner subclasses it with its own counts (`scoring.parts.ScoredUnit`, `dedup.run.DedupUnit`)."""

    what = "commit record"
    unit: str
    rows: int
    errors: int = 0
    rank: int | None = None
    node: str | None = None
    fingerprint: dict[str, int] | None = None

    def problems(self):
        if self.rows < 0 or not 0 <= self.errors <= self.rows:
            yield "errors", f"{self.errors} error rows of {self.rows} rows"


@dataclass(frozen=True)
class WrittenBy:
    """The run a finished output records: its id and its settings' digest."""

    run_id: str | None
    settings_sha1: str | None


@dataclass(frozen=True)
class ReadBack:
    """What the store reads back from an output, through its owner's format: which run wrote it
    (None: not a pairclean output), and the run manifest written beside it."""

    written_by: Callable[[Path], WrittenBy | None]
    manifest: Callable[[Path], Path]


@dataclass(frozen=True)
class RunInfo(Record):
    """run.json: the run's id (stored in its output's provenance) and whether it replaces an output."""

    what = "run record"
    run_id: str
    replaces_output: bool
    started_at: str | None = None


@dataclass(frozen=True)
class RunStart:
    """What `PartStore.begin` decided: a fresh or a resumed run, and its units in output order."""

    resumed: bool
    units: list[str]


def part_problem(source, unit: str, rows: int) -> str | None:
    """Why a part does not hold what its commit record says (None: it does): unreadable or cut
    short, another unit's, or another row count; read from its footer only."""
    try:
        meta = pq.read_metadata(source)
    except Exception as exc:  # noqa: BLE001 - whatever a truncated or foreign file raises
        return f"unreadable ({' '.join(str(exc).split())[:120]})"
    written_for = (meta.metadata or {}).get(UNIT_METADATA)
    if written_for is None or written_for.decode(errors="replace") != unit:
        return "written for another unit" if written_for is not None else "not a part of this run"
    if meta.num_rows != rows:
        return f"{meta.num_rows} rows where its commit record says {rows}"
    return None


class PartStore:
    """The parts directory of one run (see the module); `record`: the commit record type its owner reads."""

    def __init__(self, directory: Path | RemotePath, file_of: Callable[[str], str] = str,
                 record: type[CommitRecord] = CommitRecord):
        self.dir = directory if isinstance(directory, RemotePath) else Path(directory)
        self.remote = isinstance(self.dir, RemotePath)
        self.file_of = file_of  # a unit -> the file it is read from (a vanished one is only a failed unit)
        self.record_type = record
        self._lock_fd: int | None = None
        self._lock_key = ""

    @staticmethod
    def _stem(unit: str) -> str:
        return "part-" + hashlib.sha1(unit.encode()).hexdigest()[:20]

    def part_path(self, unit: str) -> Path | RemotePath:
        return self.dir / f"{self._stem(unit)}.parquet"

    def record_path(self, unit: str) -> Path | RemotePath:
        return self.dir / f"{self._stem(unit)}.done.json"

    def open_part(self, unit: str) -> pq.ParquetFile:
        """A committed unit's part, for reading (on disk or in the store)."""
        path = self.part_path(unit)
        return pq.ParquetFile(path.open() if self.remote else path)

    def committed(self) -> Keyed[str, CommitRecord]:
        """Commit records of finished units, keyed by unit (only those whose part file exists)."""
        records = {}
        if not self.dir.is_dir():
            return records
        parts = {path.name for path in self.dir.glob("part-*.parquet")}
        for path in self.dir.glob("part-*.done.json"):
            try:
                record = self.record_type.from_json(json.loads(path.read_text()), path)
            except (OSError, ValueError, RecordError):
                continue  # an unreadable record means the unit is redone
            if path != self.record_path(record.unit):
                continue  # so does one that is not a commit record of its own unit
            if self.part_path(record.unit).name in parts:
                records[record.unit] = record
        return records

    def verified(self, records: Keyed[str, CommitRecord]) -> Keyed[str, CommitRecord]:
        """The records whose parts hold what they say (footers read): the others are withdrawn, so
        their units are scored again, and named in a warning. Call before a resumed run trusts them."""
        def problem(unit: str) -> str | None:
            path, rows = self.part_path(unit), records[unit].rows
            if not self.remote:
                return part_problem(path, unit, rows)
            with path.open() as fh:
                return part_problem(fh, unit, rows)

        with ThreadPoolExecutor(FOOTER_READERS) as pool:  # on an object store each footer is a request or two
            found = dict(zip(records, pool.map(problem, records)))
        bad = {unit: why for unit, why in found.items() if why}
        for unit in bad:
            self.record_path(unit).unlink(missing_ok=True)
        if bad:
            first = next(iter(bad))
            notice(f"{len(bad)} committed part(s) in {self.dir} do not hold what their commit records say (first: "
                   f"{first}: {bad[first]}); their units are scored again")
        return {u: r for u, r in records.items() if u not in bad}

    def commit_table(self, unit: str, table: pa.Table, record: dict, fingerprint: bool = True,
                     **write_options) -> CommitRecord:
        """Write any part (a table of rows, its footer naming the unit) and then its commit record
        (`rows` added, and `errors` 0 unless the record counts error rows): the commit protocol of
        every run that keeps parts here (scoring's scores, dedup's assignments and clusters). The
        record names who committed it (the torchrun rank, or the Ray node) and, for a unit read
        from a file (`fingerprint`), that file's fingerprint."""
        record = {**record, "rank": int(os.environ.get("RANK", "0")), "node": os.environ.get(NODE_ENV),
                  "fingerprint": file_fingerprint(self.file_of(unit)) if fingerprint else None}
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), UNIT_METADATA: unit.encode()})
        with atomic_path(self.part_path(unit), temp_dir=self._temps()) as tmp:
            pq.write_table(table, tmp, **write_options)
        fault_point("part-written")
        committed = self.record_type(**{**record, "unit": unit, "rows": table.num_rows})
        write_json(self.record_path(unit), committed.to_json(), temp_dir=self._temps())
        fault_point("committed")
        return committed

    def _temps(self) -> Path | None:
        """Where a write's temp lives: the parts directory on disk (a killed run's leftovers go with it)."""
        return None if self.remote else self.dir

    # -- starting, resuming, finishing ------------------------------------------------------

    def _lock(self) -> None:
        """Hold an exclusive lock on the run for the life of this process.

        A POSIX record lock (lockf): it belongs to the process, so it is released when the
        process dies however it dies (a SIGKILLed run never blocks its own resume), DataLoader
        workers forked from it do not inherit it, and it works over NFS. One descriptor per
        directory per process (closing any descriptor of the file drops a POSIX lock), so a
        retry in the same process after an exception takes the lock over.
        """
        if self._lock_fd is not None or self.remote:
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
        """Empty the directory except the lock file we hold (a link inside is removed, never followed)."""
        for entry in self.dir.iterdir():
            if entry.name == "lock":
                continue
            if self.remote:
                entry.remove_tree()
            elif entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()

    def check_place(self) -> None:
        """The parts directory is a directory of the run's own: a link (to a folder the user keeps) or a
        file is refused before anything in it is read, cleared or removed."""
        if self.remote:
            return
        if os.path.islink(self.dir):
            raise ConfigError(f"{self.dir}, the parts directory of `out`, is a symbolic link: a run keeps its parts in "
                              "a directory of its own (it empties it when the run starts over); remove the link", "out")
        if os.path.lexists(self.dir) and not os.path.isdir(self.dir):
            raise ConfigError(f"{self.dir}, the parts directory of `out`, is not a directory: a run keeps its parts "
                              "there; move it away", "out")

    def read_record(self, name: str, kind: type | None = None) -> dict | list | None:
        """A run file as JSON (None when absent); `kind`: the type it must be. A file that is not
        JSON, or not of that kind, is refused (`invalid`), never repaired."""
        path = self.dir / name
        try:
            value = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path} is unreadable ({exc}); pass `overwrite` to start the run over", "overwrite") from None
        if kind is not None and not isinstance(value, kind):
            raise self.invalid(name, f"a JSON {type(value).__name__}, not a {kind.__name__}")
        return value

    def read_as(self, name: str, read):
        """A run file read as a record (`read(json)`), or None when absent; a file that is not the
        record is `invalid`, named with the field."""
        value = self.read_record(name, dict)
        if value is None:
            return None
        try:
            return read(value)
        except RecordError as exc:
            raise self.invalid(name, f"{exc.field}: {exc.problem}" if exc.field else exc.problem) from None

    def invalid(self, name: str, why: str) -> ConfigError:
        """The one error for resume state that does not describe a run: it is never trusted, never repaired."""
        return ConfigError(f"{self.dir / name} is not a valid record of the unfinished run ({why}); "
                           "pass `overwrite` to start the run over", "overwrite")

    def _start(self, settings: dict, units: list[str], replaces_output: bool) -> RunStart:
        self._clear()
        write_json(self.dir / "units.json", units, temp_dir=self._temps())
        write_json(self.dir / "run.json", RunInfo(uuid.uuid4().hex, replaces_output,
                                                  time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())).to_json(),
                   temp_dir=self._temps())
        write_json(self.dir / "settings.json", settings, temp_dir=self._temps())  # last: marks a usable run
        return RunStart(resumed=False, units=units)

    def _resume(self, settings: dict, units: list[str], earlier: dict) -> RunStart:
        """Continue the run in this directory: same settings, same units (shards that vanished
        since it started become failed units; new shards are refused)."""
        differ = settings_changes(earlier, settings, ignore=UNIT_KEYS)
        if differ:
            shown = "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in differ)
            raise ConfigError(f"{self.dir} holds an unfinished run with different settings ({shown}); "
                            "re-run with the same settings to resume, or pass `overwrite` to start over", "overwrite")
        pinned = self.read_record("units.json", list)
        if pinned is not None and (not all(isinstance(u, str) for u in pinned) or len(set(pinned)) != len(pinned)):
            raise self.invalid("units.json", "not a list of distinct units")
        if pinned is None:
            raise ConfigError(f"{self.dir} has no units.json; pass `overwrite` to start the run over", "overwrite")
        if pinned != units:
            listed, known = set(units), set(pinned)
            added = [u for u in units if u not in known]
            dropped = [u for u in pinned if u not in listed and os.path.exists(self.file_of(u))]
            if added or dropped:  # the user changed the inputs (a vanished shard is only a failed unit)
                detail = "; ".join(([f"{len(added)} new (first: {added[0]})"] if added else []) +
                                   ([f"{len(dropped)} no longer listed (first: {dropped[0]})"] if dropped else []))
                raise ConfigError(f"the input shards differ from the unfinished run in {self.dir} ({detail}); "
                                "re-run with the same inputs to resume, or pass `overwrite` to start over", "overwrite")
        return RunStart(resumed=True, units=pinned)

    def finished(self, out: Path, settings: dict, read_back: ReadBack, overwrite: bool = False,
                 resume: bool = False) -> bool:
        """Whether `out` is already the complete result of a run with these settings (nothing left
        to do; the caller reads its summary); call it before loading a model, so that what `begin`
        would refuse is refused at once. A parts directory that a kill between the output's
        rename and the cleanup left behind is removed here."""
        if overwrite and resume:
            raise ConfigError("resume and overwrite contradict each other: overwrite discards the unfinished run", "resume", "overwrite")
        self.check_place()
        if overwrite:
            return False
        unfinished = (self.dir / "settings.json").is_file()
        if not out.exists():
            if resume and not unfinished:
                raise UserError(f"nothing to resume: there is no unfinished run for {out} ({self.dir} not found)")
            return False
        written_by = read_back.written_by(out)  # None: not a pairclean output
        run_id, digest = (written_by.run_id, written_by.settings_sha1) if written_by else (None, None)
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
        self.check_place()
        existed = self.dir.is_dir()
        if existed:
            self._lock()
        try:
            if overwrite:  # the unfinished run is discarded unread
                self.dir.mkdir(parents=True, exist_ok=True)
                self._lock()
                return self._start(settings, units, replaces_output=out.exists())
            earlier = self.read_record("settings.json", dict) if existed else None
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
            if self._lock_fd is not None and not self.remote:
                remove_stale_temps(self.dir)

    def run_info(self) -> RunInfo | None:
        """run.json: the run id (stored in the output's provenance) and whether it replaces an output."""
        return self.read_as("run.json", lambda value: RunInfo.from_json(value, self.dir / "run.json"))

    def settings_sha1(self) -> str | None:
        settings = self.read_record("settings.json")
        return settings_digest(settings) if settings is not None else None

    def fresh_claims(self, name: str = "claims") -> GroupClaims:
        """The claims `name` of this run, with those of earlier (dead) runs cleared: call with the
        run lock held. Beside parts on an object store (no exclusive create there) the claims are
        on this machine, among this process and its DataLoader workers, and each rank takes its own
        share of the items (`GroupClaims.share`)."""
        if self.remote:
            return GroupClaims.on_this_machine()
        claims = self.dir / name
        if claims.is_symlink() or (claims.exists() and not claims.is_dir()):
            raise self.invalid(name, "not a directory")
        shutil.rmtree(claims, ignore_errors=True)
        claims.mkdir()
        return GroupClaims(claims)

    def write_record(self, name: str, obj) -> None:
        """A run file of the owner's (beta, packing, a stage's result), written atomically."""
        write_json(self.dir / name, obj, temp_dir=self._temps())

    def remove(self) -> None:
        if self.remote:
            self.dir.remove_tree()
        elif self.dir.is_symlink():
            self.dir.unlink()  # never the folder it points to
        else:
            shutil.rmtree(self.dir, ignore_errors=True)
        self._unlock()
