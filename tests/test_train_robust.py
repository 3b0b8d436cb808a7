"""The shared pieces of the robust-training methods (pairclean.training.robust) on real shards."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pairclean.data.dataset import open_dataset
from pairclean.training import TrainConfig
from pairclean.training.data import DROPPED, TrainBatches, index_shards
from pairclean.training.methods import MethodContext
from pairclean.backends import load_target
from pairclean.training.retrieval import JointTarget, embed_pairs, recall_metrics
from pairclean.training.robust import (EpochWeights, PairIndex, gather_pairs, pair_pass, pair_similarity, replica,
                                    write_pair_table)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture()
def ctx(tmp_path, coco_shards):
    spec = open_dataset(str(coco_shards))
    torch.manual_seed(0)
    target = load_target("pairclean-tiny", "none")
    cfg = TrainConfig(model="pairclean-tiny", pretrained="none", batch_size=8, workers=0)
    return MethodContext(dataset=spec, shards=index_shards(spec), target=target, run_dir=tmp_path, seed=0,
                         left="image", right="text", config=cfg)


def test_pair_ids_follow_the_shards_and_locate_back(ctx):
    index = PairIndex(ctx.shards)
    assert index.size == 16 and [s.rows for s in ctx.shards] == [6, 6, 4]
    ids = index.ids([ctx.shards[1].shard, ctx.shards[2].shard], torch.tensor([0, 3]))
    assert ids.tolist() == [6, 15]
    shards, positions = index.locate(ids)
    assert shards == [ctx.shards[1].shard, ctx.shards[2].shard] and positions.tolist() == [0, 3]


def test_gather_pairs_fills_unseen_pairs_with_nan():
    table = gather_pairs(4, np.array([2, 0]), {"v": np.array([0.5, 1.5], dtype=np.float32)})
    assert table.seen.tolist() == [True, False, True, False]
    assert table["v"][[0, 2]].tolist() == [1.5, 0.5] and np.isnan(table["v"][[1, 3]]).all()


def test_pair_pass_gives_every_pair_its_cosine_and_keeps_the_rng(ctx):
    index = PairIndex(ctx.shards)
    state = torch.get_rng_state()
    table = pair_pass(ctx, ctx.target, pair_similarity, index)
    assert torch.equal(torch.get_rng_state(), state)
    assert table.seen.all()
    batches = TrainBatches(ctx.dataset, ctx.target.preparer, 16, seed=0, shuffle=False)
    batch = next(iter(batches))
    with torch.no_grad():
        ctx.target.module.eval()
        sim = (ctx.target.encode("image", batch["left"]) * ctx.target.encode("text", batch["right"])).sum(-1)
    ids = index.ids(batch["shard"], batch["index"])
    np.testing.assert_allclose(table["sim"][ids], sim.numpy(), atol=1e-5)


def test_epoch_weights_leave_dropped_pairs_unread(ctx):
    index = PairIndex(ctx.shards)
    weights = EpochWeights(ctx, index)
    values = np.full(index.size, 0.25, dtype=np.float32)
    values[[0, 7, 15]] = DROPPED
    weights.write(values)
    plan = weights.plan(pairs=13)
    batch = next(iter(TrainBatches(ctx.dataset, ctx.target.preparer, 32, seed=0, shuffle=False, plan=plan)))
    read = index.ids(batch["shard"], batch["index"])
    assert sorted(read.tolist()) == sorted(set(range(16)) - {0, 7, 15})
    assert batch["weight"].tolist() == [0.25] * 13 and batch["stats"].dropped == 3
    values[7] = 1.0  # rewritten between epochs: the next reader sees the new arrays
    weights.write(values)
    batch = next(iter(TrainBatches(ctx.dataset, ctx.target.preparer, 32, seed=0, shuffle=False, plan=plan)))
    assert 7 in index.ids(batch["shard"], batch["index"]).tolist()


def test_pair_table_joins_the_truth_on_shard_and_index(ctx):
    import duckdb

    index = PairIndex(ctx.shards)
    seen = np.ones(index.size, dtype=bool)
    seen[3] = False
    labels = np.array(["clean", "noisy"] * 8, dtype=object)
    path = write_pair_table(ctx, 2, index, seen, {"y": np.linspace(0, 1, 16), "partition": labels})
    truth = ctx.run_dir / "truth.parquet"
    shards, positions = index.locate(np.arange(16))
    pq.write_table(pa.table({"shard": shards, "index": positions, "noisy": labels == "noisy"}), truth)
    agree, rows = duckdb.execute(f"SELECT avg(CAST((partition = 'noisy') = noisy AS INT)), count(*) FROM '{path}' "
                                 f"JOIN '{truth}' USING (shard, \"index\") WHERE epoch = 2").fetchone()
    assert rows == 15 and agree == 1.0


def test_joint_target_averages_the_networks_similarities(ctx, coco_shards):
    twin = replica(ctx.target)
    with torch.no_grad():
        for p in twin.module.parameters():
            p.add_(0.05 * torch.randn_like(p))
    spec = open_dataset(str(coco_shards))
    a, b = embed_pairs(ctx.target, spec, 8), embed_pairs(twin, spec, 8)
    joint = embed_pairs(JointTarget([ctx.target, twin]), spec, 8)
    expected = 0.5 * (a.left @ a.right.T + b.left @ b.right.T)
    torch.testing.assert_close(joint.left @ joint.right.T, expected, atol=1e-5, rtol=1e-5)
    assert recall_metrics(joint.left, joint.right, joint.owner).rsum >= 0
