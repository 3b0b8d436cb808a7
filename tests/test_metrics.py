"""Detection metrics against cases small enough to compute by hand, and the scores/truth join."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pairclean.cli import main
from pairclean.scorefile.contract import METADATA_KEY, SCORES_SCHEMA
from pairclean.scorefile.evaluation import detection_metrics, evaluate_detection, mean_noise_rank, oracle_threshold, rule_metrics

# Five pairs, two noisy. Sorted by sim: 0.1 N, 0.4 C, 0.5 N, 0.8 C, 0.9 C.
NOISY = np.array([True, True, False, False, False])
SIM = np.array([0.1, 0.5, 0.4, 0.8, 0.9])
WEIGHT = np.array([0.0, 0.10, 0.05, 0.14, 0.0])


def test_rule_metrics_by_hand():
    m = rule_metrics(NOISY, [True, False, True, False, False])
    assert m.clean_kept == pytest.approx(200 / 3)  # clean 2, 3, 4: pair 2 flagged
    assert m.noise_caught == pytest.approx(50.0)  # noisy 0 caught, 1 missed
    assert m.balanced_accuracy == pytest.approx((200 / 3 + 50) / 2)
    assert m.precision == pytest.approx(50.0)  # 2 flagged, 1 noisy
    assert m.flagged == 2


def test_rule_metrics_undefined_without_a_class():
    m = rule_metrics([False, False], [False, True])
    assert m.clean_kept == 50.0 and m.noise_caught is None and m.balanced_accuracy is None


def test_oracle_finds_the_best_balanced_threshold():
    # sim <= 0.1: 50/100 -> 75; <= 0.4: 50/66.7; <= 0.5: 100/66.7 -> 83.3; <= 0.8: 100/33.3
    o = oracle_threshold(NOISY, SIM)
    assert o.threshold == pytest.approx(0.5)
    assert o.noise_caught == pytest.approx(100.0)
    assert o.clean_kept == pytest.approx(200 / 3)
    assert o.balanced_accuracy == pytest.approx(250 / 3)


def test_mean_noise_rank_with_ties():
    # weights descending: 0.14 (1), 0.10 (2), 0.05 (3), then 0.0 twice (4 and 5 -> 4.5 each)
    rank, optimum = mean_noise_rank(NOISY, WEIGHT)
    assert rank == pytest.approx((4.5 + 2) / 2)
    assert optimum == pytest.approx(4.5)  # the two noisy pairs last: ranks 4 and 5
    assert mean_noise_rank(NOISY, np.arange(5.0)) == (pytest.approx(4.5), pytest.approx(4.5))  # noisy ranked last


def test_threshold_free_metrics_by_hand():
    m = detection_metrics(NOISY, SIM, WEIGHT, {"beta": SIM <= 0.3})
    # 6 (noisy, clean) pairs; the noisy one is lower in 5 of them (0.5 > 0.4 is the miss)
    assert m.roc_auc == pytest.approx(5 / 6)
    # ranked by -sim: N (precision 1/1), C, N (2/3) -> AP = (1 + 2/3) / 2
    assert m.average_precision == pytest.approx((1 + 2 / 3) / 2)
    assert m.rules["beta"].noise_caught == pytest.approx(50.0)
    assert m.rules["oracle"].threshold == pytest.approx(0.5)
    assert m.noisy == 2 and m.noise_share == pytest.approx(40.0)


def _scores_file(path, shard, keys, sims, beta=0.3, errors=()):
    n = len(keys)
    sim = pa.array(sims, pa.float32(), mask=np.array([i in errors for i in range(n)]))
    table = pa.table({
        "key": keys, "shard": [shard] * n, "index": list(range(n)), "sim": sim,
        "sim_debiased": pa.array([s - beta for s in sims], pa.float32()),
        "weight": pa.array(WEIGHT.tolist()[:n] + [0.0] * (n - len(WEIGHT)), pa.float32()),
        "weight_norm": pa.array([0.0] * n, pa.float32()),
        "osa_noisy": [s <= beta for s in sims], "p_clean": pa.array([0.5] * n, pa.float32()),
        "gmm_noisy": [s <= 0.45 for s in sims], "error": [("bad" if i in errors else None) for i in range(n)],
    }, schema=SCORES_SCHEMA.with_metadata({METADATA_KEY: json.dumps({"beta": beta}).encode()}))
    pq.write_table(table, path)
    return path


def test_evaluate_detection_joins_on_shard_and_index_with_repeated_keys(tmp_path):
    scores = _scores_file(tmp_path / "s.parquet", "/data/a/x.tar", ["k"] * 5, SIM.tolist())
    truth = tmp_path / "t.parquet"
    # The truth names the shard by another directory: the file-name join applies; keys repeat.
    pq.write_table(pa.table({"key": ["k"] * 5, "shard": ["elsewhere/x.tar"] * 5, "index": list(range(5)),
                             "noisy": NOISY.tolist()}), truth)
    m = evaluate_detection(scores, truth)
    assert m.join == "shard file name, index"
    assert m.pairs == 5 and m.noisy == 2
    assert m.roc_auc == pytest.approx(5 / 6)
    assert m.rules["beta"].threshold == pytest.approx(0.3)
    # beta rule sim <= 0.3 flags pair 0 only; GMM rule sim <= 0.45 flags pairs 0 and 2
    assert m.rules["beta"].noise_caught == pytest.approx(50.0)
    assert m.rules["beta"].clean_kept == pytest.approx(100.0)
    assert m.rules["gmm"].clean_kept == pytest.approx(200 / 3)


def test_evaluate_detection_leaves_out_error_and_unlabelled_rows(tmp_path):
    sims = SIM.tolist() + [0.7]
    scores = _scores_file(tmp_path / "s.parquet", "x.tar", [f"k{i}" for i in range(6)], sims, errors={1})
    truth = tmp_path / "t.parquet"
    pq.write_table(pa.table({"key": [f"k{i}" for i in range(5)], "noisy": NOISY.tolist()}), truth)
    m = evaluate_detection(scores, truth)
    assert m.join == "key"
    assert m.error_rows == 1 and m.unlabelled_rows == 1
    assert m.pairs == 4 and m.noisy == 1  # pair 1 (noisy) is an error row


def test_evaluate_detection_cli_writes_json_and_rejects_unmatched_truth(tmp_path, capsys):
    scores = _scores_file(tmp_path / "s.parquet", "x.tar", [f"k{i}" for i in range(5)], SIM.tolist())
    truth = tmp_path / "t.parquet"
    pq.write_table(pa.table({"key": [f"k{i}" for i in range(5)], "noisy": NOISY.tolist()}), truth)
    main(["evaluate", "detection", str(scores), "--truth", str(truth)])  # returns normally on success
    out = capsys.readouterr().out
    assert "oracle" in out and "ROC-AUC" in out
    saved = json.loads((tmp_path / "s.detection.t.json").read_text())
    assert saved["roc_auc"] == pytest.approx(5 / 6)
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"key": ["zz"], "noisy": [True]}), other)
    with pytest.raises(SystemExit) as exit_info:
        main(["evaluate", "detection", str(scores), "--truth", str(other), "--overwrite"])
    assert exit_info.value.code == 2
    assert "matches no scored pair" in capsys.readouterr().err
