"""The scoring run: one lifecycle for every producer of similarities.

    producer (a model over shards, or precomputed embeddings) -> one part per unit (committed)
    -> finalize (the decision rules over all pairs) -> the scores file

The lifecycle owns what every scoring run shares: validation, the unit list and its packing into
groups, beta (resolved once, saved with where it came from), the remaining groups, claimed one at a
time by whichever rank (or DataLoader worker) is free, finalize and the provenance. What every
resumable run shares (the output guard, pinned settings, fresh / resumed / finished, commits,
clean-up) is `runs.open_run`'s.
A producer owns only how its units become similarities (`Producer`): a new kind of input is one
producer class, not a second pipeline.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, ClassVar, Iterator

from pairclean.config import COSINE, COUNT, SEED, SHARE, at_least, check_choice, check_settings, pinned_settings, setting, unpinned
from pairclean.core.beta import BETA_MODES, BetaEstimate, check_beta_mode, resolve_beta, shuffled_beta
from pairclean.core.scorer import WEIGHT_FUNCTIONS
from pairclean.data.units import unit_shard
from pairclean.errors import ConfigError, UserError
from pairclean.ops import distributed
from pairclean.ops.guard import Output
from pairclean.ops.progress import SILENT, Progress
from pairclean.ops.records import JsonObject, StateDict
from pairclean.runs import GroupClaims, PartStore, Run, by_node, by_rank, open_run
from pairclean.scorefile.contract import (READ_BACK, ErrorCount, Provenance, Summary, read_provenance, read_summary,
                                       run_manifest_path, write_run_manifest)
from pairclean.scorefile.rules import DEFAULT_RULES, build_rules
from pairclean.scoring.batches import ScoringCounts
from pairclean.scoring.engines import Engine, LocalEngine
from pairclean.scoring.finalize import failed_units, finalize
from pairclean.scoring.parts import (GROUPS_RECORD, ScoredUnit, common_errors, error_counts, load_beta,
                                     load_groups, save_beta)

# commit(unit, columns, record): the producer hands each finished unit's rows to the run.
Commit = Callable[[str, dict, dict], None]


@dataclass
class RunConfig:
    """The settings every scoring run shares, whatever produces its similarities."""

    beta_mode: str = "random-inputs"
    beta: float | None = setting(None, COSINE)  # for beta_mode == "fixed"
    weight_fn: str = "cubic"
    seed: int = setting(0, SEED)
    gmm_sample: int = setting(1_000_000, at_least(2))
    rules: tuple[str, ...] = DEFAULT_RULES  # decision-rule specs NAME[:key=value,...] (pairclean.scorefile.rules)
    max_error_share: float | None = setting(None, SHARE, pinned=False)  # fail the run (no scores file) when more pairs than this are errors
    group_units: int | None = setting(None, COUNT, pinned=False)  # units per group (None: packed by the producer); pinned in the packing
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


@dataclass(frozen=True)
class Finishing:
    """What a producer adds when its run finishes: its provenance entries (`estimator`, `pair`,
    `input_shards`, `dataset`, ...) and extra summary entries."""

    provenance: dict
    summary: dict = field(default_factory=dict)


class Producer(ABC):
    """Turns units into similarities. The lifecycle calls, in order: `units()`, `settings()`,
    `prepare()` (after the finished-run check, before anything is written: build and so
    validate a model; on a Ray cluster in each worker, whose `prepared()` the driver `adopt`s),
    `started(resumed)` (rank 0, once the run is pinned: a fresh run or a resumed one), `groups(units, processes)` (once, when a run starts: the packing is then pinned),
    `random_beta()` (beta mode random-inputs only), `score(work, commit)` wherever the engine scores,
    then `finish(records, counts, todo, beta)` on rank 0."""

    beta_modes: ClassVar[tuple[str, ...]] = BETA_MODES
    device_type: str = "cpu"  # "cuda": each rank is set to its GPU (`gpu_of_rank`); the group is gloo either way

    def __getstate__(self) -> StateDict:
        """What a Ray worker receives: the producer without the driver's progress display."""
        state = dict(vars(self))
        if isinstance(state.get("cfg"), RunConfig):
            state["cfg"] = replace(state["cfg"], progress=SILENT)
        return state

    @abstractmethod
    def units(self) -> list[str]:
        """Every unit, in output order."""

    def settings(self) -> JsonObject:
        """This producer's part of what a resumed run must share (the run adds its own and the units)."""
        return {}

    def prepare(self) -> None:
        """Nothing to build."""

    def started(self, resumed: bool) -> None:
        """Nothing of its own to set up (a producer that writes beside the parts prepares it here)."""

    def groups(self, units: list[str], processes: int) -> list[list[str]]:
        """Units packed into groups whose pairs may share batches: one unit each unless the
        producer batches across units. `processes`: how many read groups at once (ranks, Ray workers)."""
        return [[unit] for unit in units]

    def input_files(self) -> list[str]:
        """What the run reads besides its units' shards (the directories and files the user named,
        a checkpoint, a keys file ...): the output must not overwrite, contain or lie inside them."""
        return []

    @abstractmethod
    def random_beta(self) -> tuple[BetaEstimate, str]:
        """beta from random inputs (beta mode random-inputs) and where it came from."""

    def readers(self) -> int:
        """How many groups one process reads at once (its DataLoader workers): a Ray worker is handed
        at least this many."""
        return 1

    def prepared(self):
        """What the driver needs of what `prepare` built where the units are scored (a Ray worker):
        handed to `adopt` on the driver. Nothing, unless the producer builds something."""
        return None

    def adopt(self, prepared) -> None:
        """Take what `prepared` returned in a worker (the driver built nothing itself)."""

    def missing_beta(self) -> ConfigError | None:
        """The error for a beta mode outside `beta_modes`: why it cannot be had here (None: the generic one)."""
        return None

    @abstractmethod
    def score(self, work: Work, commit: Commit) -> ScoringCounts:
        """Score the groups this process claims from `work`, `commit` each unit not yet done as soon
        as its last row is scored; this process's counts (summed over ranks by the run; `pairs` is
        counted from the commits)."""

    @abstractmethod
    def finish(self, records: dict[str, ScoredUnit], counts: ScoringCounts, todo: int,
               beta: BetaEstimate | None) -> Finishing:
        """The producer's provenance entries and extra summary entries (`Finishing`). `counts`:
        `score`'s, summed over ranks, with `pairs` (scored by this run);
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


def unusable_run(units: list[str], records: dict[str, ScoredUnit], store: PartStore,
                 max_error_share: float | None) -> str | None:
    """Why a run's result is not worth a scores file (None: it is): every unit failed, every pair
    is an error row, or more pairs than `max_error_share` are (the reason then names that field).
    The reason names the commonest errors."""
    rows = sum(records[u].rows for u in units)
    errors = sum(records[u].errors for u in units)
    failed = [u for u in units if records[u].failure]
    if units and len(failed) == len(units) and not rows:
        return (f"every input unit failed ({len(units)}), no pair was read; first: {unit_shard(failed[0])}: "
                f"{records[failed[0]].failure}")
    if rows and errors == rows:
        return f"every pair ({rows:,}) is an error row: {common_errors(store, units)}"
    if max_error_share is not None and rows and errors / rows > max_error_share:
        return (f"{errors:,} of {rows:,} pairs ({errors / rows:.1%}) are error rows, more than `max_error_share` "
                f"{max_error_share:g}: {common_errors(store, units)}")
    if not rows:
        return "the inputs hold no pair"
    return None


def fail_run(reason: str, units: list[str], records: dict[str, ScoredUnit], run: Run, provenance: dict) -> None:
    """End a run that gives no scores file: its reasons in the run manifest, the parts removed (so
    the corrected command starts afresh), nothing else written; then the one-line error."""
    failures = failed_units(units, records)
    summary = Summary(pairs=sum(records[u].rows for u in units), errors=sum(records[u].errors for u in units),
                      unit_failures=failures, failed_units=len(failures), units=len(units),
                      error_reasons=[ErrorCount(**count) for count in error_counts(run.store, units)], failed=reason)
    write_run_manifest(run.out, summary, Provenance(**provenance), written=False)
    run.close()
    message = f"{reason}; no scores file was written (all reasons in {run_manifest_path(run.out)})"
    raise ConfigError(message, "max_error_share") if "`max_error_share`" in reason else UserError(message)


@dataclass(frozen=True)
class Begun:
    """What starting a scoring run decided on rank 0 and told the others: fresh or resumed, its
    units, beta and where it came from (and how long it took), and the work left."""

    resumed: bool
    units: list[str]
    beta: BetaEstimate | None
    beta_source: str
    beta_seconds: float
    work: Work


def _begin(run: Run, producer: Producer, cfg: RunConfig, engine: Engine) -> Begun:
    """Rank 0 (the driver): start or resume the run, then beta and the packing, each pinned once."""
    started = run.begin()
    producer.started(started.resumed)
    began = time.perf_counter()
    saved = load_beta(run.store)
    if saved is not None:
        beta, source = saved
    else:
        beta, source = resolve_beta(cfg.beta_mode, cfg.beta, lambda: engine.random_beta(producer))
        if beta is not None:
            save_beta(run.store, beta, source)
    groups = load_groups(run.store, started.units)
    if groups is None:  # packed once, when the run starts: a resumed run batches alike
        units = started.units
        groups = ([units[i:i + cfg.group_units] for i in range(0, len(units), cfg.group_units)] if cfg.group_units
                  else producer.groups(units, engine.processes()))
        run.store.write_record(GROUPS_RECORD, groups)
    # Claims are made after the committed units are known, so a job restarted with another
    # world size still scores every remaining unit exactly once.
    work = Work([(i, g) for i, g in enumerate(groups) if any(u not in started.done for u in g)], started.done,
                run.claims())
    return Begun(started.resumed, started.units, beta, source, time.perf_counter() - began, work)


def run_scoring(producer: Producer, out: str | Path | Output, cfg: RunConfig, engine: Engine | None = None) -> ScoreResult:
    """Score every unit of `producer` into `out` (Parquet, on disk or on an object store) on
    `engine` (default: this process, or each torchrun rank); resumes an interrupted run."""
    engine = engine or LocalEngine()
    try:
        return _run_scoring(producer, out, cfg, engine)
    finally:
        engine.close()


def _run_scoring(producer: Producer, out: str | Path | Output, cfg: RunConfig, engine: Engine) -> ScoreResult:
    distributed.init_from_env(device_type=producer.device_type, share_gpus=True)  # ranks may share a GPU
    progress = cfg.progress if distributed.is_main() else SILENT
    check_beta_mode(cfg.beta_mode, cfg.beta, producer.beta_modes, producer.missing_beta() or "")
    units = producer.units()
    # The output (with its parts directory and run manifest beside it) may touch no input.
    run = open_run(out, [*dict.fromkeys(unit_shard(u) for u in units), *producer.input_files()],
                   {**pinned_settings(cfg), **producer.settings()}, units, READ_BACK, unit_shard,
                   overwrite=cfg.overwrite, resume=cfg.resume, record=ScoredUnit)
    out = run.out
    # Under torchrun, rank 0 alone decides (finished? fresh or resumed? beta) and tells the others.
    finished = distributed.on_main(run.finished)
    if finished:  # the same command, re-run after it finished: nothing to do
        return ScoreResult(out, read_summary(out), 0.0, 0, True, read_provenance(out), already_complete=True)
    engine.prepare(producer, run.store)
    begun = distributed.on_main(lambda: _begin(run, producer, cfg, engine))
    units, work, beta = begun.units, begun.work, begun.beta
    todo = len(units) - len(work.done)
    started, cpu_started = time.perf_counter(), time.process_time()
    with progress.task("scoring", total=len(units), completed=len(work.done), pairs=0, rate=0.0) as task:
        scored = {"pairs": 0}

        def on_commit(units_now: int, pairs: int) -> None:
            scored["pairs"] += pairs
            elapsed = time.perf_counter() - started
            task.update(advance=units_now, pairs=scored["pairs"], rate=scored["pairs"] / elapsed if elapsed else 0.0)

        counts = engine.score(producer, run.store, work, on_commit)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    # The whole job's counts (also a barrier); every rank reduces the same fields, in the same order.
    counts = replace(counts, pairs=scored["pairs"])
    counts = ScoringCounts(**{name: int(distributed.all_reduce_sum(value)) for name, value in asdict(counts).items()})
    scored_now = counts.pairs
    elapsed = distributed.all_reduce_sum(elapsed) / distributed.world_size()
    if not distributed.is_main():
        return ScoreResult(out, None, elapsed, scored_now, begun.resumed)

    records = run.committed()
    missing = [u for u in units if u not in records]
    if missing:
        raise RuntimeError(f"{len(missing)} unit(s) were not committed (first: {missing[0]})")
    reason = unusable_run(units, records, run.store, cfg.max_error_share)
    if beta is None and reason is None:
        beta = shuffled_beta([records[u].shuffled for u in units])
    produced = producer.finish(records, counts, todo, None if reason else beta)
    scored_here = [records[u] for u in units if u not in work.done]
    provenance = {**produced.provenance, "seed": cfg.seed, "beta_mode": cfg.beta_mode, "beta_source": begun.beta_source,
                  "world_size": distributed.world_size(), "units_by_rank": by_rank(scored_here),
                  **engine.provenance(), **({"units_by_node": nodes} if (nodes := by_node(scored_here)) else {})}
    if reason:
        fail_run(reason, units, records, run, provenance)
    summary = finalize(run, units, beta, cfg.weight_fn, cfg.seed, cfg.gmm_sample, provenance, records, cfg.rules,
                       progress)
    summary = replace(summary, **produced.summary, pairs_per_second=scored_now / elapsed if elapsed > 0 else 0.0,
                      scoring_seconds=elapsed, scoring_cpu_seconds=cpu, beta_seconds=begun.beta_seconds,
                      beta_source=begun.beta_source)
    run.close()
    return ScoreResult(out, summary, elapsed, scored_now, begun.resumed, read_provenance(out))
