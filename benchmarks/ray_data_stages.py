"""What the Ray engine's design was chosen against: the same scoring as Ray Data stages (NeMo Curator's
shape: read + decode as Ray tasks on any node's CPUs, the towers in an actor pool through
`map_batches`), against today's pipeline inside one Ray actor (`--engine ray`), on the same
shards, in one run.

    python benchmarks/ray_data_stages.py SHARDS --model pairclean-tiny --batch-size 64 --decoders 2 --rounds 2

Stages: 1. `map_batches(prepare)` over the packed groups, one group a task: the library's own
`PreparedBatches` reads and decodes each group into `PairBatch`es (the same objects the DataLoader
workers build), handed on through Ray's object store; 2. `map_batches(Encode, concurrency=1)`: an
actor that builds the estimator once and encodes each batch (device preprocessing, towers,
cosines). Printed: pairs/s of each way (the
scoring only: the estimator is built, and the Ray workers started, before the clock starts) and
the ratio. The way kept is argued from these figures in docs/distributed.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shards")
    parser.add_argument("--model", default="pairclean-tiny")
    parser.add_argument("--pretrained", default="none")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--decoders", type=int, default=2, help="Decoding tasks at once (Ray Data) and DataLoader "
                                                                 "workers (the actor's pipeline).")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()

    import ray
    import torch

    from pairclean.backends import build_estimator
    from pairclean.data.dataset import open_dataset
    from pairclean.data.spec import modalities
    from pairclean.runs import GroupClaims
    from pairclean.scoring.batches import PreparedBatches
    from pairclean.scoring.model import ScoreConfig, pack_units
    from pairclean.scoring.pipeline import Scorer, finish_on_device
    from pairclean.scoring.run import Work

    dataset = open_dataset(args.shards)
    units = dataset.units()
    pairs = sum(dataset.count(u) for u in units)
    groups = pack_units(units, pairs / len(units), args.batch_size, readers=args.decoders)
    left, right = modalities(dataset.spec.pair)
    ray.init(num_cpus=args.decoders + 1, include_dashboard=False, log_to_driver=False)

    def build():
        torch.manual_seed(0)
        return build_estimator("open_clip", model=args.model, pretrained=args.pretrained, device="cpu",
                               precision="fp32", decode="fast", compile=False, cpu_decode_share=0.0)

    preparer = build().preparer

    def prepare(rows: dict):
        for index, members in zip(rows["group"], rows["units"]):
            work = Work([(int(index), list(members))], frozenset(), GroupClaims.on_this_machine())
            for batch in PreparedBatches(dataset, work, preparer, args.batch_size)._batches():
                yield {"batch": np.array([batch], dtype=object)}

    class Encode:
        def __init__(self):
            torch.set_num_threads(1)
            self.estimator = build()
            self.scorer = Scorer(self.estimator, left, right)

        def __call__(self, rows: dict) -> dict:
            keys, sims = [], []
            for batch in rows["batch"]:
                batch = finish_on_device(self.estimator, batch, left, right)
                u, v = self.scorer.encode(batch)
                scored = self.scorer.score(batch, u, v)
                result = scored.results.wait()["sims"].numpy()
                keys += [batch.key[i] for i in scored.encoded]
                sims += result.tolist()
            return {"key": np.array(keys, dtype=object), "sim": np.array(sims, dtype=np.float32)}

    def ray_data() -> tuple[float, dict]:
        items = ray.data.from_items([{"group": i, "units": g} for i, g in enumerate(groups)])
        stages = (items.map_batches(prepare, batch_size=1, num_cpus=1, concurrency=args.decoders)
                  .map_batches(Encode, batch_size=1, num_cpus=1, concurrency=1))
        began = time.perf_counter()
        rows = stages.take_all()
        return time.perf_counter() - began, {r["key"]: r["sim"] for r in rows}

    # today's pipeline in one actor, started (and its estimator built) before the clock starts
    from pairclean.scoring.model import ModelProducer
    from pairclean.scoring.ray_engine import ScoringWorker

    cfg = ScoreConfig(model=args.model, pretrained=args.pretrained, device="cpu", batch_size=args.batch_size,
                      workers=args.decoders, beta_cache=False)
    producer = ModelProducer(dataset, cfg)
    producer.units()

    class Sink:  # the actor's commits dropped (no part store: the stages above write none either)
        def record_path(self, unit):
            return Path("/nonexistent") / unit.replace("/", "_")

        def commit_table(self, unit, table, record, **_):
            pass

    actor = ray.remote(ScoringWorker).options(num_cpus=1).remote(producer, Sink())
    ray.get(actor.prepared.remote())

    def in_actor() -> float:
        began = time.perf_counter()
        ray.get(actor.score.remote(list(enumerate(groups)), frozenset()))
        return time.perf_counter() - began

    report = {"pairs": pairs, "groups": len(groups), "rounds": []}
    for number in range(args.rounds):
        actor_seconds = in_actor()
        stage_seconds, sims = ray_data()
        row = {"actor_pipeline_pairs_per_second": round(pairs / actor_seconds, 1),
               "ray_data_pairs_per_second": round(pairs / stage_seconds, 1),
               "ray_data_vs_actor": round(actor_seconds / stage_seconds, 3), "scored_by_ray_data": len(sims)}
        report["rounds"].append(row)
        print(f"round {number}: pipeline in one actor {row['actor_pipeline_pairs_per_second']:,} pairs/s, "
              f"Ray Data stages {row['ray_data_pairs_per_second']:,} pairs/s (ratio {row['ray_data_vs_actor']}), "
              f"{len(sims)} of {pairs} pairs", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
