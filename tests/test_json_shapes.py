"""The JSON people read keeps its keys now that the reports are records (issue 54): `evaluate
detection --json` (and the demo's detection.json, written the same way) with and without a blind
audit, a rule's ECE present (a number, or null when the rule abstains) or absent (no probability
claimed); `evaluate dedup --json` with and without a noise truth; the retrieval metrics of
`evaluate retrieval --json` and of metrics.jsonl's `val_` entries, in their order. The expected
trees are the keys the dict-building code wrote before (at 14879fb)."""

from __future__ import annotations

import json
from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pairclean.cli import main
from test_audit import _blind_marks, blind_page  # noqa: F401 (a fixture)
from test_duplicates import hand_case
from test_metrics import NOISY, SIM, _scores_file

SHARES = {"clean_kept", "noise_caught", "balanced_accuracy", "precision", "flagged"}
RULE = SHARES | {"threshold", "label", "noisy_if", "abstains"}
ORACLE = SHARES | {"threshold", "label", "noisy_if"}
TOP = {"pairs", "noisy", "noise_share", "rules", "roc_auc", "average_precision", "mean_noise_rank",
       "mean_noise_rank_optimal", "mean_noise_rank_by_sim", "scores", "truth", "join", "scores_rows", "error_rows",
       "unlabelled_rows", "truth_rows", "estimator", "beta_mode", "weight_fn"}
ESTIMATE = {"value", "low", "high", "effective_n", "sampled"}
STRATUM = {"stratum", "sim_above", "sim_at_most", "pairs", "drawn"}
AUDIT = {"marked", "scored_pairs", "confidence", "interval", "design", "unmarked_strata", "judge", "covers",
         "noise_share", "rules"}
RULE_AUDIT = {"label", "noisy_if", "abstains", "flagged_share", "precision", "recall", "noise_left"}
DEDUP = {"dedup", "truth", "join", "side", "threshold", "keep", "rows", "predicted_pairs", "correct_pairs",
         "true_pairs", "found_pairs", "precision", "recall", "kinds", "removed", "planted_groups",
         "planted_groups_found", "planted_groups_one_kept"}
NOISE = {"noise_truth", "noise_join", "kept_noisy", "kept_noisy_share", "noisy_share_in_groups"}
RETRIEVAL = ["i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "rsum", "queries_i2t", "queries_t2i",
             "skipped"]


def test_detection_json_keeps_its_keys_with_an_ece_and_without_one(tmp_path):
    scores = _scores_file(tmp_path / "s.parquet", "x.tar", [f"k{i}" for i in range(5)], SIM.tolist())
    pq.write_table(pa.table({"key": [f"k{i}" for i in range(5)], "noisy": NOISY.tolist()}), tmp_path / "t.parquet")
    main(["evaluate", "detection", str(scores), "--truth", str(tmp_path / "t.parquet"), "--json", str(tmp_path / "d.json")])
    written = json.loads((tmp_path / "d.json").read_text())
    assert set(written) == TOP  # no `audit` without a blind audit's marks
    assert list(written["rules"]) == ["beta", "gmm", "oracle"]
    assert set(written["rules"]["beta"]) == RULE  # the beta rule claims no probability: no `ece`
    assert set(written["rules"]["gmm"]) == RULE | {"ece"} and written["rules"]["gmm"]["ece"] is not None
    assert set(written["rules"]["oracle"]) == ORACLE


def test_detection_json_of_a_blind_audit_keeps_its_keys(blind_page, coco_scores, truth, tmp_path, capsys):  # noqa: F811
    marks = _blind_marks(blind_page, truth, tmp_path / "marks.json")
    main(["audit-import", str(marks), "--out", str(tmp_path / "audit.parquet")])
    main(["evaluate", "detection", str(coco_scores), "--truth", str(tmp_path / "audit.parquet"),
          "--json", str(tmp_path / "d.json")])
    written = json.loads((tmp_path / "d.json").read_text())
    assert set(written) == TOP | {"audit"}
    assert set(written["rules"]["gmm"]) == RULE | {"ece"} and written["rules"]["gmm"]["abstains"]
    assert written["rules"]["gmm"]["ece"] is None  # an abstaining rule's probability is no claim
    audit = written["audit"]
    assert set(audit) == AUDIT
    assert set(audit["design"]) == {"version", "seed", "scores", "scored_pairs", "strata", "repeated"}
    assert all(set(s) == STRATUM for s in audit["design"]["strata"])
    assert set(audit["judge"]) == {"repeated", "disagreed", "agreement", "error_rate"}
    assert set(audit["judge"]["error_rate"]) == {"value", "low", "high"}
    assert set(audit["noise_share"]) == ESTIMATE
    assert set(audit["rules"]) == {"beta", "gmm"}
    for rule in audit["rules"].values():
        assert set(rule) == RULE_AUDIT
        assert all(set(rule[what]) == ESTIMATE for what in ("precision", "recall", "noise_left"))


def test_dedup_json_keeps_its_keys_with_and_without_a_noise_truth(tmp_path, capsys):
    dedup, truth, noise = hand_case(tmp_path)
    main(["evaluate", "dedup", str(dedup), "--truth", str(truth), "--side", "image", "--json", str(tmp_path / "a.json")])
    main(["evaluate", "dedup", str(dedup), "--truth", str(truth), "--noise-truth", str(noise), "--side", "image",
          "--json", str(tmp_path / "b.json")])
    alone, with_noise = (json.loads((tmp_path / name).read_text()) for name in ("a.json", "b.json"))
    assert set(alone) == DEDUP and set(with_noise) == DEDUP | NOISE
    assert set(alone["kinds"]) == {"resize", "caption"}
    assert all(set(kind) == {"true_pairs", "found", "recall", "precision"} for kind in alone["kinds"].values())


def test_retrieval_json_keeps_its_keys_in_their_order():
    """metrics.jsonl is written in the order of its keys: `val_` + these, as before."""
    from pairclean.training.retrieval import METRIC_NAMES, recall_metrics

    eye = torch.eye(3)
    measured = replace(recall_metrics(eye, eye, torch.arange(3)), skipped=2)
    assert list(measured.to_json()) == RETRIEVAL and list(METRIC_NAMES) == RETRIEVAL[:7]
    assert measured.to_json()["skipped"] == 2 and measured.rsum == 600.0
