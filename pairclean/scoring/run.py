"""The scoring run: one lifecycle for every producer of similarities.

    producer (a model over shards, or precomputed embeddings) -> one part per unit (committed)
    -> finalize (the decision rules over all pairs) -> the scores file

The lifecycle owns what every run shares: validation, the unit list, its packing into groups and
the pinned settings, the part store (fresh, resumed, or already finished), beta (resolved once,
saved with where it came from), the remaining groups, claimed one at a time by whichever rank (or
DataLoader worker) is free, finalize, provenance and clean-up.
A producer owns only how its units become similarities (`Producer`): a new kind of input is one
producer class, not a second pipeline.
"""

from __future__ import annotations

import hashlib
import json
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, ClassVar, Iterator

from pairclean.config import FINITE, SEED, SHARE, at_least, check_choice, check_settings, pinned_settings, setting, unpinned
from pairclean.core.beta import BETA_MODES, BetaEstimate, check_beta_mode, resolve_beta, shuffled_beta
from pairclean.core.scorer import WEIGHT_FUNCTIONS
from pairclean.errors import ConfigError, UserError
from pairclean.ops import distributed
from pairclean.data.units import unit_fingerprint, unit_shard
from pairclean.ops.guard import Output, open_output
from pairclean.ops.progress import SILENT, Progress
from pairclean.scores.contract import (ErrorCount, Provenance, Summary, read_provenance, read_summary,
                                       run_manifest_path, write_run_manifest)
from pairclean.scores.rules import DEFAULT_RULES, build_rules
from pairclean.scoring.finalize import failed_units, finalize
from pairclean.scoring.parts import GroupClaims, PartStore, parts_dir_for

# commit(unit, columns, record): the producer hands each finished unit's rows to the run.
Commit = Callable[[str, dict, dict], None]


@dataclass
class RunConfig:
    """The settings every scoring run shares, whatever produces its similarities."""

    beta_mode: str = "random-inputs"
    beta: float | None = setting(None, FINITE)  # for beta_mode == "fixed"
    weight_fn: str = "cubic"
    seed: int = setting(0, SEED)
    gmm_sample: int = setting(1_000_000, at_least(2))
    rules: tuple[str, ...] = DEFAULT_RULES  # decision-rule specs NAME[:key=value,...] (pairclean.scores.rules)
    max_error_share: float | None = setting(None, SHARE, pinned=False)  # fail the run (no scores file) when more pairs than this are errors
    overwrite: bool = unpinned(False)
    resume: bool = unpinned(False)  # insist on continuing an unfinished run (re-running resumes anyway)
    progress: Progress = unpinned(SILENT)

    def __post_init__(self):
        check_settings(self)  # every declared setting, of this class and of a subclass
        check_choice(self.weight_fn, WEIGHT_FUNCTIONS, "weight_fn", "weight function")
        check_beta_mode(self.beta_mode, self.beta)  # a known mode, and a value for `fixed`
        build_rules(self.rules)  # an unknown rule or option fails before anything is scored


@dataclass
class Work:
    """What is left of a run: the groups (index in the pinned packing, units in order) that hold a
    unit still to score, the units already committed, and the claims that hand each group to one
    process. A group is always read whole, so its pairs fall in the same batches whether or not
    some of its units were committed by an earlier run; only the others are committed again."""

    groups: list[tuple[int, list[str]]]
    done: frozenset[str]
    claims: GroupClaims

    def claimed(self) -> Iterator[list[str]]:
        """The groups this process claims, in order (call it in the process that reads them)."""
        for index, units in self.groups:
            if self.claims.claim(index):
                yield units


class Producer(ABC):
    """Turns units into similarities. The lifecycle calls, in order: `units()`, `settings()`,
    `prepare()` (after the finished-run check, before anything is written: build and so
    validate a model), `started(resumed)` (rank 0, once the run is pinned: a fresh run or a
    resumed one), `groups(units)` (once, when a run starts: the packing is then pinned),
    `random_beta()` (beta mode random-inputs only), `score(work, commit, task)` on every rank,
    then `finish(records, counters, todo, beta)` on rank 0."""

    beta_modes: ClassVar[tuple[str, ...]] = BETA_MODES
    device_type: str = "cpu"  # torch.distributed backend choice: "cuda" -> NCCL, else gloo

    @abstractmethod
    def units(self) -> list[str]:
        """Every unit, in output order."""

    def settings(self) -> dict:
        """This producer's part of what a resumed run must share (the run adds its own and the units)."""
        return {}

    def prepare(self) -> None:
        """Nothing to build."""

    def started(self, resumed: bool) -> None:
        """Nothing of its own to set up (a producer that writes beside the parts prepares it here)."""

    def groups(self, units: list[str]) -> list[list[str]]:
        """Units packed into groups whose pairs may share batches: one unit each unless the
        producer batches across units."""
        return [[unit] for unit in units]

    def input_files(self) -> list[str]:
        """Files the run reads besides its units' shards (a checkpoint, a keys file ...): the output
        must not overwrite them."""
        return []

    @abstractmethod
    def random_beta(self) -> tuple[BetaEstimate, str]:
        """beta from random inputs (beta mode random-inputs) and where it came from."""

    def missing_beta(self) -> ConfigError | None:
        """The error for a beta mode outside `beta_modes`: why it cannot be had here (None: the generic one)."""
        return None

    @abstractmethod
    def score(self, work: Work, commit: Commit, task) -> dict[str, int]:
        """Score the groups this process claims from `work`, `commit` each unit not yet done as soon
        as its last row is scored; extra counters (the same names on every rank, summed over ranks;
        `pairs` is counted from the commits)."""

    @abstractmethod
    def finish(self, records: dict[str, dict], counters: dict[str, int], todo: int,
               beta: BetaEstimate | None) -> tuple[dict, dict]:
        """(provenance entries: `estimator`, `pair`, `input_shards`, `dataset`, ...; extra summary
        entries). `counters`: `score`'s, summed over ranks, with `pairs` (scored by this run);
        `beta`: the run's, None when the run gives no scores file (nothing is to be marked complete)."""


@dataclass
class ScoreResult:
    out: Path
    summary: Summary | None  # None on the ranks other than 0 (under torchrun only rank 0 finalizes)
    seconds: float
    pairs_scored_now: int
    resumed: bool
    provenance: Provenance | None = None
    already_complete: bool = False  # the output was already this run's finished result

    @property
    def pairs_per_second(self) -> float:
        return self.pairs_scored_now / self.seconds if self.seconds > 0 else 0.0


def units_settings(units: list[str]) -> dict:
    return {"units_sha1": hashlib.sha1(json.dumps(units).encode()).hexdigest(), "n_units": len(units)}


def check_unchanged(records: dict[str, dict]) -> None:
    """Refuse to resume over committed units whose file changed since (a vanished file is only
    a failed unit, as elsewhere): their rows would describe data that is no longer there."""
    changed = [u for u, rec in records.items() if rec.get("fingerprint") is not None
               and unit_fingerprint(u) not in (None, rec["fingerprint"])]
    if changed:
        raise ConfigError(f"{unit_shard(changed[0])} changed since the unfinished run scored it "
                        f"({len(changed)} unit(s) changed): pass `overwrite` to score the inputs again", "overwrite")


def unusable_run(units: list[str], records: dict[str, dict], store: PartStore,
                 max_error_share: float | None) -> str | None:
    """Why a run's result is not worth a scores file (None: it is): every unit failed, every pair
    is an error row, or more pairs than `max_error_share` are (the reason then names that field).
    The reason names the commonest errors."""
    rows = sum(records[u]["rows"] for u in units)
    errors = sum(records[u]["errors"] for u in units)
    failed = [u for u in units if records[u].get("failure")]
    if units and len(failed) == len(units) and not rows:
        return (f"every input unit failed ({len(units)}), no pair was read; first: {unit_shard(failed[0])}: "
                f"{records[failed[0]]['failure']}")
    if rows and errors == rows:
        return f"every pair ({rows:,}) is an error row: {store.common_errors(units)}"
    if max_error_share is not None and rows and errors / rows > max_error_share:
        return (f"{errors:,} of {rows:,} pairs ({errors / rows:.1%}) are error rows, more than `max_error_share` "
                f"{max_error_share:g}: {store.common_errors(units)}")
    if not rows:
        return "the inputs hold no pair"
    return None


def fail_run(reason: str, units: list[str], records: dict[str, dict], store: PartStore, out: Path,
             provenance: dict) -> None:
    """End a run that gives no scores file: its reasons in the run manifest, the parts removed (so
    the corrected command starts afresh), nothing else written; then the one-line error."""
    failures = failed_units(units, records)
    summary = Summary(pairs=sum(records[u]["rows"] for u in units), errors=sum(records[u]["errors"] for u in units),
                      unit_failures=failures, failed_units=len(failures), units=len(units),
                      error_reasons=[ErrorCount(**count) for count in store.error_counts(units)], failed=reason)
    write_run_manifest(out, summary, Provenance(**provenance), written=False)
    store.remove()
    message = f"{reason}; no scores file was written (all reasons in {run_manifest_path(out)})"
    raise ConfigError(message, "max_error_share") if "`max_error_share`" in reason else UserError(message)


def run_scoring(producer: Producer, out: str | Path | Output, cfg: RunConfig) -> ScoreResult:
    """Score every unit of `producer` into `out` (Parquet); resumes an interrupted run."""
    distributed.init_from_env(device_type=producer.device_type)
    progress = cfg.progress if distributed.is_main() else SILENT
    check_beta_mode(cfg.beta_mode, cfg.beta, producer.beta_modes, producer.missing_beta() or "")
    target = open_output(out, (), "out", overwrite=None)  # the parent exists, the spelling is a local file
    units = producer.units()
    # The run also writes its parts directory and run manifest beside the output: neither may touch an input.
    target = open_output(target, [*dict.fromkeys(unit_shard(u) for u in units), *producer.input_files()],
                         companions=[parts_dir_for(target.path), run_manifest_path(target.path)])
    out = target.path
    store = PartStore(parts_dir_for(out))
    settings = {**pinned_settings(cfg), **producer.settings(), **units_settings(units)}
    # Under torchrun, rank 0 alone decides (finished? fresh or resumed? beta) and tells the others.
    finished = distributed.on_main(lambda: store.finished(out, settings, overwrite=cfg.overwrite, resume=cfg.resume))
    if finished:  # the same command, re-run after it finished: nothing to do
        return ScoreResult(out, read_summary(out), 0.0, 0, True, read_provenance(out), already_complete=True)
    producer.prepare()

    def start_run():
        start = store.begin(out, settings, units, overwrite=cfg.overwrite, resume=cfg.resume)
        producer.started(start.resumed)
        began = time.perf_counter()
        saved = store.load_beta()
        if saved is not None:
            beta, source = saved
        else:
            beta, source = resolve_beta(cfg.beta_mode, cfg.beta, producer.random_beta)
            if beta is not None:
                store.save_beta(beta, source)
        groups = store.load_groups(start.units)
        if groups is None:  # packed once, when the run starts: a resumed run batches alike
            groups = producer.groups(start.units)
            store.save_groups(groups)
        done = store.committed()
        check_unchanged(done)
        # Claims are made after the committed units are known, so a job restarted with another
        # world size still scores every remaining unit exactly once.
        work = Work([(i, g) for i, g in enumerate(groups) if any(u not in done for u in g)],
                    frozenset(u for u in start.units if u in done), store.fresh_claims())
        return start.units, start.resumed, beta, source, time.perf_counter() - began, work

    units, resumed, beta, beta_source, beta_seconds, work = distributed.on_main(start_run)
    todo = len(units) - len(work.done)
    started, cpu_started = time.perf_counter(), time.process_time()
    with progress.task("scoring", total=len(units), completed=len(work.done), pairs=0, rate=0.0) as task:
        scored = {"pairs": 0}

        def commit(unit: str, columns: dict, record: dict) -> None:
            store.commit(unit, columns, {**record, "rank": distributed.rank(), "fingerprint": unit_fingerprint(unit)})
            scored["pairs"] += len(columns["key"])
            elapsed = time.perf_counter() - started
            task.update(advance=1, pairs=scored["pairs"], rate=scored["pairs"] / elapsed if elapsed else 0.0)

        counters = producer.score(work, commit, task)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    # The whole job's counters (also a barrier); every rank reports the same names, in the same order.
    counters = {name: int(distributed.all_reduce_sum(value)) for name, value in
                sorted({**counters, "pairs": scored["pairs"]}.items())}
    scored_now = counters["pairs"]
    elapsed = distributed.all_reduce_sum(elapsed) / distributed.world_size()
    if not distributed.is_main():
        return ScoreResult(out, None, elapsed, scored_now, resumed)

    records = store.committed()
    missing = [u for u in units if u not in records]
    if missing:
        raise RuntimeError(f"{len(missing)} unit(s) were not committed (first: {missing[0]})")
    reason = unusable_run(units, records, store, cfg.max_error_share)
    if beta is None and reason is None:
        beta = shuffled_beta([records[u].get("shuffled") for u in units])
    produced, extra = producer.finish(records, counters, todo, None if reason else beta)
    by_rank = [records[u]["rank"] for u in units if u not in work.done and "rank" in records[u]]
    provenance = {**produced, "seed": cfg.seed, "beta_mode": cfg.beta_mode, "beta_source": beta_source,
                  "world_size": distributed.world_size(),
                  "units_by_rank": {str(r): by_rank.count(r) for r in sorted(set(by_rank))}}
    if reason:
        fail_run(reason, units, records, store, out, provenance)
    summary = finalize(store, units, target, beta, cfg.weight_fn, cfg.seed, cfg.gmm_sample, provenance, records,
                       cfg.rules)
    summary = replace(summary, **extra, pairs_per_second=scored_now / elapsed if elapsed > 0 else 0.0,
                      scoring_seconds=elapsed, scoring_cpu_seconds=cpu, beta_seconds=beta_seconds,
                      beta_source=beta_source)
    store.remove()
    return ScoreResult(out, summary, elapsed, scored_now, resumed, read_provenance(out))
