"""Where a scoring run's units are scored: the engines, one class each, in a registry.

    local  this process (and its DataLoader workers), or each torchrun rank: the producer scores
           the groups it claims and commits each unit as its last row is in (today's pipeline)
    ray    a Ray cluster (`scoring.ray_engine`): workers (actors, a GPU each where the cluster has
           them) each run the same pipeline over the groups the driver hands them, and commit
           into the same part store; a lost worker's groups are handed to another

The driver does what rank 0 does either way (the run's guard, start or resume, beta, the packing,
finalize: `scoring.run.run_scoring`); an engine only builds the estimator where the units are
scored (`prepare`), answers beta on random inputs there, and scores the work left (`score`). A
new engine is one subclass registered with `@register_engine`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from importlib import import_module
from typing import Callable, ClassVar

from pairclean.config import check_choice
from pairclean.core.beta import BetaEstimate
from pairclean.ops import distributed
from pairclean.runs import PartStore
from pairclean.ops.records import JsonObject
from pairclean.scoring.batches import ScoringCounts
from pairclean.scoring.parts import PART_WRITE_OPTIONS, part_table

ENGINES: dict[str, type[Engine]] = {}
LAZY_ENGINES = {"ray": "pairclean.scoring.ray_engine"}  # registered when first asked for (Ray is an extra)
ENGINE_NAMES = ("local", *LAZY_ENGINES)

# on_commit(units, pairs): the driver's progress, told after units were committed.
OnCommit = Callable[[int, int], None]


def register_engine(cls: type[Engine]) -> type[Engine]:
    ENGINES[cls.name] = cls
    return cls


def unit_committer(store: PartStore) -> Callable[[str, dict, dict], None]:
    """commit(unit, columns, record): a unit's rows as its part, committed in `store` (in the
    process that scored them: the driver, a torchrun rank or a Ray worker)."""

    def commit(unit: str, columns: dict, record: dict) -> None:
        part = part_table(columns)
        store.commit_table(unit, part.table, {**record, "errors": part.errors, "null_rows": part.null_rows},
                           **PART_WRITE_OPTIONS)

    return commit


class Engine(ABC):
    """Runs a producer's work (see the module)."""

    name: ClassVar[str]

    def processes(self) -> int:
        """How many processes read groups at once (the packing cuts at least that many per worker)."""
        return distributed.world_size()

    @abstractmethod
    def prepare(self, producer, store: PartStore) -> None:
        """Build what scores (the estimator) where the units will be scored, which commit into `store`."""

    @abstractmethod
    def random_beta(self, producer) -> tuple[BetaEstimate, str]:
        """beta from random inputs through the estimator, and where it came from."""

    @abstractmethod
    def score(self, producer, store: PartStore, work, on_commit: OnCommit) -> ScoringCounts:
        """Score `work` (`scoring.run.Work`), committing each unit into `store`; the producer's
        counts of this process (summed over ranks by the run)."""

    def provenance(self) -> JsonObject:
        """The engine's entries in the scores file's provenance."""
        return {"engine": self.name}

    def close(self) -> None:
        """Nothing held."""


@register_engine
class LocalEngine(Engine):
    """This process and its DataLoader workers (or each torchrun rank: the groups are claimed)."""

    name = "local"

    def prepare(self, producer, store: PartStore) -> None:
        producer.prepare()

    def random_beta(self, producer) -> tuple[BetaEstimate, str]:
        return producer.random_beta()

    def score(self, producer, store: PartStore, work, on_commit: OnCommit) -> ScoringCounts:
        commit = unit_committer(store)

        def committing(unit: str, columns: dict, record: dict) -> None:
            commit(unit, columns, record)
            on_commit(1, len(columns["key"]))

        return producer.score(work, committing)


def build_engine(name: str, **options) -> Engine:
    """The engine `name` (`engine`), with its own options (the ray engine's address, workers, GPUs)."""
    check_choice(name, ENGINE_NAMES, "engine")
    if name in LAZY_ENGINES:
        import_module(LAZY_ENGINES[name])
    return ENGINES[name](**options)
