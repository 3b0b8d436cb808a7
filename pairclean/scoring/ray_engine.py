"""`score --engine ray`: the units scored by workers of a Ray cluster.

The driver (this process: `pairclean score`, or a `ray job submit` entrypoint) does what rank 0
does (`scoring.run.run_scoring`): the guard, start or resume, beta, the packing, finalize. Here it
starts `ScoringWorker` actors - one per GPU where the cluster has GPUs (`gpus` each, a fraction of
one for small models), else one per node - each of which builds the estimator once and runs
today's pipeline (DataLoader workers decoding on its node's CPUs, the towers on its GPU) over
the groups the driver hands it, a few at a time, committing every unit into the run's part store
(beside the output: on an object store when the nodes share no filesystem).

A worker that dies (its node removed, preempted, out of memory) loses only its groups in flight:
the driver hands them to another worker (and asks Ray for a replacement, which starts when the
cluster has room). Commit records make a unit count once however often it is retried: a worker
skips the units of its groups already committed, and a part is only ever complete. The choice of
one pipeline per actor over Ray Data stages, and its figures, are in docs/distributed.md.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

from pairclean.core.beta import BetaEstimate
from pairclean.errors import ConfigError, UserError
from pairclean.runs import NODE_ENV, GroupClaims, PartStore
from pairclean.ops.extras import optional
from pairclean.ops.records import JsonObject
from pairclean.scoring.batches import ScoringCounts
from pairclean.scoring.engines import Engine, OnCommit, register_engine, unit_committer

CHUNK_SHARE = 2  # a chunk is 1/(this x workers) of the groups left (guided self-scheduling: large first, small last)
PROBE_SECONDS = 4  # an address where nothing accepts a connection within this is refused
CONNECT_SECONDS = 8  # one where no Ray cluster lets us in within this is refused
LOST_SECONDS = 600  # with no live worker for this long (none can be placed), the run stops
FORWARDED_ENV = ("PAIRCLEAN_", "HF_HUB_OFFLINE", "HF_HOME", "TRANSFORMERS_OFFLINE")  # the driver's, to every worker


def check_address(address: str | None) -> None:
    """Refuse at once an address that does not answer (Ray would retry for a minute or more)."""
    if not address or address in ("auto", "local"):
        return
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if not host or not port:
        raise ConfigError(f"`ray_address` {address!r} is not HOST:PORT (or ray://HOST:PORT)", "ray_address")
    try:
        socket.create_connection((host, port), timeout=PROBE_SECONDS).close()
    except OSError as exc:
        raise ConfigError(f"`ray_address` {address}: no Ray cluster answers there ({exc.strerror or exc}); start its "
                          "head node (Ray's `ray start`), or leave it unset to start Ray on this machine", "ray_address") from None


@dataclass(frozen=True)
class WorkerPlan:
    """How many scoring workers to start, and what each asks Ray for (`ray.remote(...).options(**options)`)."""

    count: int
    options: JsonObject


class ScoringWorker:
    """A Ray actor: the producer prepared once (its estimator built here), then chunks of groups
    scored through the pipeline and committed into the run's part store."""

    def __init__(self, producer, store: PartStore):
        import ray

        os.environ[NODE_ENV] = ray.get_runtime_context().get_node_id()[:12]
        self.node = os.environ[NODE_ENV]
        self.producer, self.store = producer, store
        producer.prepare()

    def prepared(self):
        return self.producer.prepared()

    def random_beta(self) -> tuple[BetaEstimate, str]:
        return self.producer.random_beta()

    def score(self, groups: list[tuple[int, list[str]]], done: frozenset[str]) -> tuple[ScoringCounts, int]:
        """Score these groups; (the producer's counts, the units committed). A unit
        already committed (by an earlier attempt at this chunk) only fills its batches."""
        from pairclean.scoring.run import Work

        done = frozenset(done) | {u for _, units in groups for u in units if self.store.record_path(u).exists()}
        commit, committed = unit_committer(self.store), [0, 0]

        def counting(unit: str, columns: dict, record: dict) -> None:
            commit(unit, columns, record)
            committed[0] += 1
            committed[1] += len(columns["key"])

        with tempfile.TemporaryDirectory(prefix="pairclean-claims-") as claims:  # among this worker's DataLoader workers
            counts = self.producer.score(Work(groups, done, GroupClaims(Path(claims))), counting)
        return replace(counts, pairs=committed[1]), committed[0]


@register_engine
class RayEngine(Engine):
    name = "ray"

    def __init__(self, address: str | None = None, workers: int | None = None, gpus: float | None = None):
        self.ray = optional("ray", "ray")
        address = address or os.environ.get("RAY_ADDRESS")
        check_address(address)
        self._connect(address)
        self.wanted, self.gpus = workers, gpus
        self.workers: list = []
        self.lost = 0

    def _connect(self, address: str | None) -> None:
        """Join the cluster at `address` (None: start Ray here). Something else answering there, or a
        cluster that does not let us in, is refused within CONNECT_SECONDS: Ray itself would retry
        for a minute or more. The connecting thread is left behind (a daemon) when it does not return."""
        env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV)}
        outcome: dict = {}

        def connect() -> None:
            try:
                self.ray.init(address=address or None, ignore_reinit_error=True, logging_level=logging.ERROR,
                              log_to_driver=False, include_dashboard=False,
                              runtime_env={"env_vars": env} if env else None)
            except Exception as exc:  # noqa: BLE001 - said as one line below, whatever Ray raised
                outcome["error"] = exc

        if not address or address in ("local",):
            # Ray started here: as long as starting takes. Its workers run at the driver's priority (Ray's
            # default niceness of 15 would hand a busy machine's CPUs to everything else first).
            os.environ.setdefault("RAY_worker_niceness", "0")
            connect()
        else:
            joining = threading.Thread(target=connect, name="pairclean-ray-connect", daemon=True)
            joining.start()
            joining.join(CONNECT_SECONDS)
            if joining.is_alive():
                raise ConfigError(f"`ray_address` {address}: no Ray cluster answered within {CONNECT_SECONDS} s (something "
                                  "else listens there?); give the head node's address", "ray_address")
        if "error" in outcome:
            reason = " ".join(str(outcome["error"]).split())[:300]
            raise ConfigError(f"`ray_address` {address or 'local'}: cannot join Ray ({reason})", "ray_address")

    def processes(self) -> int:
        return max(1, len(self.workers))

    def _worker_options(self) -> WorkerPlan:
        """How many workers, and what each asks Ray for: a GPU (or `gpus` of one) and a CPU where the
        cluster has GPUs (its DataLoader workers use the node's other cores); on a cluster without
        GPUs a node's CPUs each (the smallest node's count), so one worker a node runs the towers
        on all its cores (Ray sets a worker's threads to the CPUs it asked for)."""
        resources = self.ray.cluster_resources()
        gpus = self.gpus if self.gpus is not None else (1.0 if resources.get("GPU", 0) >= 1 else 0.0)
        nodes = [n for n in self.ray.nodes() if n.get("Alive")]
        cpus = 1 if gpus else max(1, int(min((n["Resources"].get("CPU", 1) for n in nodes), default=1)))
        count = self.wanted or (int(resources.get("GPU", 0) // gpus) if gpus else len(nodes)) or 1
        return WorkerPlan(count, {"num_cpus": cpus, "num_gpus": gpus, "max_restarts": 0,
                                  "scheduling_strategy": "SPREAD"})

    def _worker(self, producer, store: PartStore):
        return self.ray.remote(ScoringWorker).options(**self.plan.options).remote(producer, store)

    def prepare(self, producer, store: PartStore) -> None:
        """Start the workers (each builds the estimator: a model that cannot be built fails here,
        before anything is written) and adopt what the first one built."""
        self.plan = self._worker_options()
        self.workers = [self._worker(producer, store) for _ in range(self.plan.count)]
        producer.adopt(self._first_ready([w.prepared.remote() for w in self.workers]))

    def _first_ready(self, refs: list):
        """The first answer among `refs` (a worker's error, a UserError in it, is raised as itself)."""
        while refs:
            done, refs = self.ray.wait(refs, num_returns=1, timeout=LOST_SECONDS)
            if not done:
                raise UserError(f"no Ray worker started within {LOST_SECONDS} s: does the cluster have "
                                f"{self.plan.options['num_gpus']:g} GPU(s) and {self.plan.options['num_cpus']} "
                                "CPU(s) free per worker?")
            try:
                return self.ray.get(done[0])
            except self.ray.exceptions.RayActorError:
                continue  # that worker died: another may answer
            except self.ray.exceptions.RayTaskError as exc:
                raise _cause(exc) from None
        raise UserError("every Ray worker died while starting (see the Ray logs: `ray logs`)")

    def random_beta(self, producer) -> tuple[BetaEstimate, str]:
        return self._first_ready([self.workers[0].random_beta.remote()])

    def score(self, producer, store: PartStore, work, on_commit: OnCommit) -> ScoringCounts:
        """Hand the groups out in chunks, a chunk per idle worker - large first, smaller as the
        queue empties, never fewer groups than a worker's DataLoader workers; a chunk whose worker
        died goes back to the front of the queue (a replacement worker is asked for)."""
        ray = self.ray
        queue = deque(work.groups)
        readers = producer.readers()
        starting = {w.prepared.remote(): w for w in self.workers}
        idle, running, totals = [], {}, ScoringCounts()
        lonely_since = None
        while queue or running:
            while idle and queue:
                size = max(readers, -(-len(queue) // (CHUNK_SHARE * len(self.workers))))
                worker, chunk = idle.pop(), [queue.popleft() for _ in range(min(size, len(queue)))]
                running[worker.score.remote(chunk, work.done)] = (worker, chunk)
            if not running and not starting:
                raise UserError("every Ray worker was lost and none can be started; the committed units are kept: "
                                "run the same command again when the cluster has room")
            done, _ = ray.wait([*running, *starting], num_returns=1, timeout=30)
            if not running:
                lonely_since = lonely_since or time.monotonic()
                if time.monotonic() - lonely_since > LOST_SECONDS:
                    raise UserError(f"no Ray worker could be started for {LOST_SECONDS} s after the last was lost; "
                                    "the committed units are kept: run the same command again")
            for ref in done:
                if ref in starting:
                    worker = starting.pop(ref)
                    if self._answered(ref):
                        idle.append(worker)
                        lonely_since = None
                    continue
                worker, chunk = running.pop(ref)
                try:
                    counts, units = ray.get(ref)
                except ray.exceptions.RayActorError:
                    self.lost += 1
                    queue.extendleft(reversed(chunk))  # its committed units are skipped when they run again
                    self.workers.remove(worker)
                    replacement = self._worker(producer, store)
                    self.workers.append(replacement)
                    starting[replacement.prepared.remote()] = replacement
                    continue
                except ray.exceptions.RayTaskError as exc:
                    raise _cause(exc) from None
                totals += counts
                on_commit(units, counts.pairs)
                idle.append(worker)
        return totals

    def _answered(self, ref) -> bool:
        try:
            self.ray.get(ref)
            return True
        except self.ray.exceptions.RayActorError:
            return False
        except self.ray.exceptions.RayTaskError as exc:
            raise _cause(exc) from None

    def provenance(self) -> JsonObject:
        return {"engine": self.name, "workers_lost": self.lost}

    def close(self) -> None:
        for worker in self.workers:
            self.ray.kill(worker)
        self.workers = []


def _cause(exc) -> Exception:
    """The exception a Ray task raised, as itself (a UserError stays one line)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, Exception) else exc
