"""The resumable run's lifecycle, written once for every run that keeps parts (scoring, dedup).

    run = open_run(out, inputs, settings, units, read_back, ...)   # the output guard, once
    finished = distributed.on_main(run.finished)   # the same run already done? (before any model is built)
    started = distributed.on_main(run.begin)       # fresh or resumed; committed units whose file changed refused
    ... the owner's work: run.claims(name) hands items out, run.commit(unit, table, record) commits one
    with run.write_output() as tmp: ...            # rank 0: the output, renamed into place when complete
    run.close()                                    # the parts removed

A run is pinned by its settings and its units (a resumed run must share both), holds the run
lock, and names in the output's provenance the run that wrote it (`identity`): re-running the
same command after it finished does nothing, an unfinished one resumes, and an output is
replaced only with `overwrite`.
"""

from __future__ import annotations

import hashlib
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import pyarrow as pa

from pairclean.errors import ConfigError
from pairclean.ops import distributed
from pairclean.ops.cache import cache_dir
from pairclean.ops.guard import Output, open_output
from pairclean.ops.places import RemotePath, is_remote
from pairclean.ops.records import Keyed
from pairclean.ops.urls import local_path
from pairclean.runs.claims import GroupClaims
from pairclean.runs.store import (NODE_ENV, CommitRecord, PartStore, ReadBack, file_fingerprint, parts_dir_for,
                                  units_settings)


@dataclass(frozen=True)
class Started:
    """What starting decided (rank 0, broadcast): a fresh or a resumed run, its units in output
    order (a resumed run's pinned ones), and those already committed."""

    resumed: bool
    units: list[str]
    done: frozenset[str]


@dataclass(frozen=True)
class RunIdentity:
    """The run's part of its output's provenance: which run wrote it, under which settings, when."""

    run_id: str | None
    settings_sha1: str | None
    finished_at: str


class Run:
    """One resumable run writing one output (`target`, already guarded) through a part store."""

    def __init__(self, target: Output, settings: dict, units: list[str], read_back: ReadBack,
                 file_of: Callable[[str], str], overwrite: bool, resume: bool,
                 record: type[CommitRecord] = CommitRecord, parts: Path | RemotePath | None = None):
        self.target, self.out = target, target.path
        self.store = PartStore(parts or parts_dir_for(target.path), file_of, record)
        self.settings = {**settings, **units_settings(units)}
        self.units, self.read_back, self.file_of = units, read_back, file_of
        self.overwrite, self.resume = overwrite, resume

    def finished(self) -> bool:
        """Whether the output is already this run's complete result (nothing to do: the caller
        reads its summary); call it on rank 0 before building anything, so what `begin` would
        refuse is refused at once."""
        return self.store.finished(self.out, self.settings, self.read_back, overwrite=self.overwrite,
                                   resume=self.resume)

    def begin(self) -> Started:
        """Start the run or resume the unfinished one (rank 0). A committed unit whose file changed
        since is refused: its rows would describe data that is no longer there; one whose part
        does not hold what its record says is scored again (`PartStore.verified`)."""
        start = self.store.begin(self.out, self.settings, self.units, overwrite=self.overwrite, resume=self.resume)
        units = set(start.units)
        # every committed part is checked, the owner's later stages' too (dedup's groups of clusters)
        done = {u: r for u, r in self.store.verified(self.store.committed()).items() if u in units}
        self._check_unchanged(done)
        return Started(start.resumed, start.units, frozenset(done))

    def _check_unchanged(self, records: dict[str, CommitRecord]) -> None:
        changed = [u for u, rec in records.items() if rec.fingerprint is not None
                   and file_fingerprint(self.file_of(u)) not in (None, rec.fingerprint)]
        if changed:
            raise ConfigError(f"{self.file_of(changed[0])} changed since the unfinished run scored it "
                              f"({len(changed)} unit(s) changed): pass `overwrite` to score the inputs again",
                              "overwrite")

    def claims(self, name: str = "claims") -> GroupClaims:
        """Fresh claims (rank 0, after `begin`: those of a dead run are cleared)."""
        return self.store.fresh_claims(name)

    def commit(self, unit: str, table: pa.Table, record: dict, fingerprint: bool = True,
               **write_options) -> CommitRecord:
        """Commit one unit's part (any rank, any Ray worker: `PartStore.commit_table`)."""
        return self.store.commit_table(unit, table, record, fingerprint, **write_options)

    def committed(self) -> Keyed[str, CommitRecord]:
        return self.store.committed()

    def identity(self) -> RunIdentity:
        """The run's part of the output's provenance (`dataclasses.asdict` it into the provenance)."""
        run = self.store.run_info()
        return RunIdentity(run.run_id if run else None, self.store.settings_sha1(),
                           time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    @contextmanager
    def write_output(self) -> Iterator[Path]:
        """A temp path for the output, in the parts directory (a kill leaves nothing beside the
        output), renamed into place when complete; an existing output is replaced only by a run
        started with `overwrite`."""
        run = self.store.run_info()
        with self.target.write(temp_dir=self.store._temps(), no_clobber=not (run and run.replaces_output)) as tmp:
            yield tmp

    def close(self) -> None:
        """The run is over (its output written, or refused): the parts go."""
        self.store.remove()


def by_rank(records: Iterable[CommitRecord]) -> Keyed[str, int]:
    """How many of these commit records each torchrun rank wrote."""
    ranks = [r.rank for r in records if r.rank is not None and r.node is None]
    return {str(r): ranks.count(r) for r in sorted(set(ranks))}


def by_node(records: Iterable[CommitRecord]) -> Keyed[str, int]:
    """How many of these commit records each Ray node wrote."""
    nodes = [r.node for r in records if r.node is not None]
    return {n: nodes.count(n) for n in sorted(set(nodes))}


def open_run(out: str | os.PathLike | Output, inputs: Iterable, settings: dict, units: list[str],
             read_back: ReadBack, file_of: Callable[[str], str] = str, overwrite: bool = False,
             resume: bool = False, record: type[CommitRecord] = CommitRecord, local_parts: bool = False) -> Run:
    """Open the run that writes `out` (on disk or on an object store) from `units`: the one output
    guard of the run, against every input (files read and directories named) for the output and
    its companions (the parts directory, the run manifest). `settings`: what a resumed run must
    share (the units are added); `file_of`: the file a unit is read from (its fingerprint is
    committed with it); `record`: the owner's commit record type; `local_parts`: an output on an
    object store keeps its parts on this machine (`local_parts_dir`: a run that works on one
    machine, dedup, resumes there), not beside it."""
    if isinstance(out, Output):
        path = out.path
    elif is_remote(out):
        path = RemotePath(str(out))
    else:
        local = local_path(str(out))
        path = Path(os.path.expanduser(local)) if local is not None and local.strip() else None  # None: open_output says why
    parts = local_parts_dir(path) if local_parts and isinstance(path, RemotePath) else None
    companions = [parts or parts_dir_for(path), read_back.manifest(path)] if path is not None else []
    target = open_output(path if isinstance(path, RemotePath) else out, inputs, "out", overwrite=None,
                         companions=[c for c in companions if c is not parts])
    return Run(target, settings, units, read_back, file_of, overwrite, resume, record, parts)


def local_parts_dir(out: RemotePath) -> Path:
    """Where a run on one machine keeps the parts of an output on an object store: in the cache,
    named after the output's URL (the same command resumes there)."""
    digest = hashlib.sha1(out.url.encode()).hexdigest()[:16]
    return cache_dir() / "runs" / f"{out.name}-{digest}.parts"
