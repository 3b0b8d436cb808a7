"""Real torchrun processes (gloo on CPU): 2-rank scoring equals 1-rank scoring, and a killed
2-rank job resumed by 1 process yields exactly the uninterrupted rows."""

from __future__ import annotations

import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from pairclean.lab.coco import build_shards
from pairclean.scoring.model import ScoreConfig, score

TINY = ["--model", "pairclean-tiny", "--pretrained", "none", "--beta-k", "64", "--workers", "0", "--batch-size", "4"]


def _torchrun(args, nproc=2, env_extra=None, check=True):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "pairclean", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def six_shards(tmp_path_factory, coco_src):
    out = tmp_path_factory.mktemp("dist") / "shards"
    build_shards(coco_src, out, shard_size=3)  # 6 shards: 3 + 3 + 3 + 3 + 3 + 1
    return out


@pytest.fixture(scope="module")
def reference(six_shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "one.parquet"
    score(str(six_shards), out, ScoreConfig(model="pairclean-tiny", pretrained="none", beta_k=64, workers=0,
                                            batch_size=4, beta_cache=False))
    return {(r["shard"], r["index"]): r for r in pq.read_table(out).to_pylist()}


def _rows(path):
    rows = pq.read_table(path).to_pylist()
    assert len({(r["shard"], r["index"]) for r in rows}) == len(rows)  # one row each
    return {(r["shard"], r["index"]): r for r in rows}


def _assert_same(rows, reference):
    assert rows.keys() == reference.keys()
    for k, r in rows.items():
        ref = reference[k]
        assert r["key"] == ref["key"] and r["error"] == ref["error"]
        for col in ("sim", "weight", "p_clean"):
            assert r[col] == pytest.approx(ref[col], abs=1e-5)


def test_two_ranks_score_the_same_rows_as_one(six_shards, reference, tmp_path):
    out = tmp_path / "two.parquet"
    _torchrun(["score", str(six_shards), "--out", str(out), *TINY, "--no-beta-cache"])
    _assert_same(_rows(out), reference)
    assert not (tmp_path / "two.parquet.parts").exists()


def test_killed_two_rank_job_resumed_by_one_process(six_shards, reference, tmp_path):
    out = tmp_path / "killed.parquet"
    # Every rank SIGKILLs itself right after its second commit: 4 of 6 units are committed.
    proc = _torchrun(["score", str(six_shards), "--out", str(out), *TINY, "--no-beta-cache"],
                     env_extra={"PAIRCLEAN_FAULT": "committed:2"}, check=False)
    assert proc.returncode != 0 and not out.exists()
    committed = list((tmp_path / "killed.parquet.parts").glob("part-*.done.json"))
    assert 0 < len(committed) < 6
    from pairclean.cli import main

    main(["score", str(six_shards), "--out", str(out), *TINY, "--no-beta-cache"])  # 1 process resumes
    _assert_same(_rows(out), reference)


def test_two_rank_training_follows_one_process_with_the_same_global_batch(coco_src, tmp_path):
    import json

    shards = tmp_path / "train"
    build_shards(coco_src, shards, shard_size=4)  # 4 shards of 4: a rank's local batch of 4 is one shard
    args = ["train", str(shards), "--model", "pairclean-tiny", "--pretrained", "none", "--epochs", "2",
            "--batch-size", "8", "--lr", "1e-3", "--warmup-steps", "1", "--workers", "0", "--shuffle-buffer", "0",
            "--log-every", "1", "--seed", "0"]
    from pairclean.cli import main

    main([*args, "--out", str(tmp_path / "one")])
    proc = _torchrun([*args, "--out", str(tmp_path / "two")])
    # torch.distributed.nn's all_gather (deprecated) printed a FutureWarning per gather, 8 in this run
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]

    def losses(run):
        lines = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [x["loss"] for x in lines if x.get("event") == "step"]

    one, two = losses("one"), losses("two")
    assert len(one) == len(two) == 4
    # Same global batches (InfoNCE does not depend on row order), gradients gathered across ranks:
    # the loss curve of 2 ranks x 4 follows 1 process x 8.
    assert two == pytest.approx(one, rel=1e-4)
    assert (tmp_path / "two" / "model-epoch-002.pt").is_file()
    assert sorted(p.name for p in (tmp_path / "two" / "diagnostics").iterdir())[:2] == \
        ["epoch-001-rank0.parquet", "epoch-001-rank1.parquet"]


def test_every_rank_leaves_the_process_group_before_the_interpreter_shuts_down(tmp_path):
    # A rank that exits with its gloo group alive can abort during interpreter finalisation (seen
    # in CI: rank 1 SIGABRT "terminate called without an active exception"). atexit handlers run
    # last-registered-first, so this probe, registered before the group exists, runs after
    # pairclean's own exit handler and sees whether the group was destroyed.
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import atexit, sys, torch.distributed as dist\n"
        "from pairclean.ops import distributed\n"
        "atexit.register(lambda: sys.stdout.write(f'initialised at exit: {dist.is_initialized()}\\n'))\n"
        "distributed.init_from_env('cpu')\n"
        "assert distributed.all_reduce_sum(1) == 2\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(probe)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("initialised at exit: False") == 2, proc.stdout


@pytest.mark.parametrize("method, options, models", [
    ("sdd", ["alpha=-100", "beta=-100"], ["model-epoch-002.pt"]),
    ("gsc", ["networks=2"], ["model-epoch-002.pt", "model-epoch-002-peer.pt"]),
])
def test_two_rank_robust_methods_run_to_the_end(coco_src, tmp_path, method, options, models):
    """Per-epoch passes split across ranks and gathered, GMMs on every rank's values, the second
    network's gradients averaged by hand: a 2-rank run finishes with every pair in the pair table."""
    shards = tmp_path / "train"
    build_shards(coco_src, shards, shard_size=4)
    args = ["train", str(shards), "--out", str(tmp_path / "run"), "--model", "pairclean-tiny", "--pretrained", "none",
            "--epochs", "2", "--batch-size", "8", "--lr", "1e-3", "--warmup-steps", "1", "--workers", "0",
            "--shuffle-buffer", "0", "--method", method, *[x for o in options for x in ("--method-option", o)]]
    _torchrun(args)
    for name in models:
        assert (tmp_path / "run" / name).is_file()
    pairs = pq.read_table(tmp_path / "run" / "diagnostics" / "pairs-epoch-002.parquet").to_pylist()
    assert len(pairs) == 16 and len({(r["shard"], r["index"]) for r in pairs}) == 16
# DiffNCL splits the rows of its batches here: with 16 pairs over 2 ranks, a random tiny model's consensus
# leaves a rank less than a batch of clean pairs, the only pairs its clean loop's loader would read.
@pytest.mark.parametrize("method, options", [
    ("sps", ["warmup_epochs=1", "e_qc=2", "e_n=2", "eps1=0.6"]),
    ("diffncl", ["warmup_epochs=1", "loops=rows"]),
])
def test_two_rank_sps_and_diffncl_train_both_networks(method, options, coco_src, tmp_path):
    import json

    shards = tmp_path / "train"
    build_shards(coco_src, shards, shard_size=4)
    run = tmp_path / "run"
    _torchrun(["train", str(shards), "--model", "pairclean-tiny", "--pretrained", "none", "--epochs", "2",
               "--batch-size", "8", "--lr", "1e-3", "--warmup-steps", "1", "--workers", "0", "--shuffle-buffer", "0",
               "--method", method, *[x for o in options for x in ("--method-option", o)], "--out", str(run)])
    assert (run / "model-epoch-002.pt").is_file() and (run / "model-epoch-002-peer.pt").is_file()
    pairs = pq.read_table(run / "diagnostics" / "pairs-epoch-002.parquet").to_pylist()
    assert len({(r["shard"], r["index"]) for r in pairs}) == len(pairs) == 16  # both ranks' pairs, gathered
    epochs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"epoch"' in x]
    last = [e for e in epochs if e.get("event") == "epoch"][-1]
    assert sum(last[f"{method}_{k}"] for k in {"sps": ("reliable", "quasi_clean", "noisy"),
                                                "diffncl": ("clean", "weak", "noisy")}[method]) == 16


@pytest.fixture(scope="module")
def twelve_groups(tmp_path_factory, coco_src):
    """12 shards of 64 pairs: at batch 4 each shard is a group of its own (16 batches), so the
    ranks claim 12 groups one at a time."""
    from test_packing import _small_jpegs, _write_shards

    return _write_shards(tmp_path_factory.mktemp("claims") / "shards", _small_jpegs(coco_src), 12, 64)


@pytest.fixture(scope="module")
def twelve_reference(twelve_groups, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref12") / "one.parquet"
    score(str(twelve_groups), out, ScoreConfig(model="pairclean-tiny", pretrained="none", beta_k=64, workers=0,
                                               batch_size=4, beta_cache=False))
    return _rows(out)


def test_a_slowed_rank_claims_fewer_groups_and_the_rows_stay_the_same(twelve_groups, twelve_reference, tmp_path):
    from pairclean.scorefile.contract import read_provenance

    out = tmp_path / "slow.parquet"
    # Rank 1 sleeps 0.3 s after each of its batches (~5 s a group); rank 0 scores a group in about a second.
    _torchrun(["score", str(twelve_groups), "--out", str(out), *TINY, "--no-beta-cache"],
              env_extra={"PAIRCLEAN_SLOW": "1:0.3"})
    _assert_same(_rows(out), twelve_reference)
    by_rank = read_provenance(out).units_by_rank
    assert sum(by_rank.values()) == 12 and by_rank.get("1", 0) < by_rank["0"], by_rank


def test_one_rank_killed_mid_job_then_the_job_resumed(twelve_groups, twelve_reference, tmp_path):
    out = tmp_path / "killed.parquet"
    # Rank 1 alone SIGKILLs itself right after its 2nd commit; torchrun then stops rank 0 mid-group.
    proc = _torchrun(["score", str(twelve_groups), "--out", str(out), *TINY, "--no-beta-cache"],
                     env_extra={"PAIRCLEAN_FAULT": "committed:2", "PAIRCLEAN_FAULT_RANK": "1"}, check=False)
    assert proc.returncode != 0 and not out.exists()
    parts = tmp_path / "killed.parquet.parts"
    committed = len(list(parts.glob("part-*.done.json")))
    claims = len(list((parts / "claims").iterdir()))
    assert 2 <= committed < 12 and claims >= committed  # the dead run's claims are left behind
    _torchrun(["score", str(twelve_groups), "--out", str(out), *TINY, "--no-beta-cache"])  # the same job again
    _assert_same(_rows(out), twelve_reference)
    assert not parts.exists()


def test_ranks_beyond_a_nodes_gpus_share_them_for_scoring_in_a_gloo_group_and_training_refuses(monkeypatch):
    """`torchrun --nproc_per_node 2` on a one-GPU node: each scoring rank runs its own host-bound
    pipeline on the one GPU, in a gloo group (NCCL refuses two ranks on a GPU; scoring's group is gloo
    on every node, so nodes with other GPU counts agree); training, whose gradients go through NCCL,
    refuses in one line. CUDA and the group are stood in for (no GPU here)."""
    import torch
    import torch.distributed as dist

    from pairclean.errors import UserError
    from pairclean.ops import distributed

    chosen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: chosen.update(gpu=index))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, timeout: chosen.update(backend=backend))
    monkeypatch.setattr(dist, "new_group", lambda backend, timeout: chosen.update(host_group=backend) or backend)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.atexit, "register", lambda fn: None)
    monkeypatch.setattr(distributed, "_host_group", None)
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    distributed.init_from_env(device_type="cuda", share_gpus=True)
    assert chosen == {"gpu": 0, "backend": "gloo"} and distributed.default_device_for_rank("auto") == "cuda:0"
    chosen.clear()
    with pytest.raises(UserError, match=r"2 ranks on this node and 1 GPU.*one rank per GPU \(start 1 a node\)"):
        distributed.init_from_env(device_type="cuda")
    assert not chosen
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # a rank per GPU: each its own
    distributed.init_from_env(device_type="cuda")  # training: NCCL, and gloo for the values the host holds
    assert chosen == {"gpu": 1, "backend": "nccl", "host_group": "gloo"} and distributed._host_group == "gloo"
    assert distributed.default_device_for_rank("auto") == "cuda:1"
    chosen.clear()
    distributed.init_from_env(device_type="cuda", share_gpus=True)  # scoring: gloo on every node, whatever its GPUs
    assert chosen == {"gpu": 1, "backend": "gloo"}
