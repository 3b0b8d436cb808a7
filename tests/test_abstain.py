"""A decision that abstains abstains everywhere (issue 25, class 6).

When the GMM rule abstains (its mixture does not separate the data), its p_clean column is NULL,
not a posterior that looks usable; a predicate over it (`filter --where`, `train --filter`) is
warned about; the report draws no GMM boundary and labels no pair "GMM: clean"; `evaluate
detection` reports no ECE for it. The share of pairs that look like random pairings is named for
what it measures, printed by `score`, and every estimated share stays within 0-100%.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import run_cli
from pairclean.scorefile.contract import Provenance, read_summary
from pairclean.scorefile.rules import recorded_rules
from test_decisions import PAIRS, _embeddings


@pytest.fixture
def abstaining(tmp_path, capsys):
    """A scores file on which the GMM rule abstains (one noisy pair of 600: nothing to separate), with truth."""
    noisy = _embeddings(tmp_path / "emb", noisy_every=10 ** 6)
    truth = tmp_path / "truth.parquet"
    pq.write_table(pa.table({"key": [f"k{i}" for i in range(PAIRS)], "noisy": noisy}), truth)
    scores = tmp_path / "s.parquet"
    code, out, err = run_cli(["score", tmp_path / "emb", "--from-embeddings", "--out", scores, "--beta-mode", "fixed",
                              "--beta", "0.1"], capsys)
    assert code == 0 and "GMM rule abstains" in err
    return scores, truth, out


def test_an_abstaining_gmm_writes_no_posterior(abstaining):
    scores, _, _ = abstaining
    table = pq.read_table(scores)
    assert table.column("p_clean").null_count == table.num_rows  # NULL, not a number that looks usable
    assert not any(table.column("gmm_noisy").to_pylist())  # it flags nothing
    gmm = next(r for r in read_summary(scores).rules if r.name == "gmm")
    assert gmm.abstains and gmm.noisy_if == f"abstains: {gmm.abstains}"


@pytest.fixture
def abstaining_shards(tmp_path, coco_shards, capsys, monkeypatch):
    """Real tar shards scored by the CLI with the GMM rule made to abstain (its separation check
    forced to fail): (shards, scores)."""
    import shutil

    import pairclean.core.mixture as mixture

    shards = Path(shutil.copytree(coco_shards, tmp_path / "shards"))
    monkeypatch.setattr(mixture, "mixture_separation", lambda m, null=None, sample=None: ({}, "forced by the test"))
    scores = tmp_path / "scores.parquet"
    assert run_cli(["score", shards, "--model", "pairclean-tiny", "--pretrained", "none", "--beta-k", "64",
                    "--workers", "0", "--out", scores], capsys)[0] == 0
    monkeypatch.undo()
    return shards, scores


def test_a_predicate_over_an_abstaining_rule_is_warned_about(abstaining_shards, tmp_path, capsys):
    shards, scores = abstaining_shards
    assert pq.read_table(scores).column("p_clean").null_count == 16
    # The README's old recipe: p_clean is NULL for every pair, so it keeps nothing, and says why.
    code, _, err = run_cli(["filter", shards, "--scores", scores, "--where", "p_clean >= 0.5 AND weight > 0",
                            "--out", tmp_path / "clean"], capsys)
    warning = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "--where" in warning[0] and "p_clean" in warning[0] and "abstains" in warning[0]
    assert "gmm_noisy" not in warning[0].split("here:")[1] and "osa_noisy" in warning[0]
    assert code == 2 and "keep none" in err and not (tmp_path / "clean").exists()
    # The decision columns are not warned about.
    code, _, err = run_cli(["filter", shards, "--scores", scores, "--where", "NOT gmm_noisy AND NOT osa_noisy",
                            "--dry-run"], capsys)
    assert code == 0 and "warning" not in err


def test_train_filter_over_an_abstaining_rule_is_warned_about(abstaining, tmp_path, caplog):
    from pairclean.scorefile.db import ScoresDB, compile_predicate

    scores, _, _ = abstaining
    with caplog.at_level(logging.WARNING, logger="pairclean"), ScoresDB(scores) as db:
        compile_predicate(db, "p_clean >= 0.5", "filter")
        compile_predicate(db, "sim > 0.1 AND NOT gmm_noisy", "filter")
    warnings = [r for r in caplog.records if "abstains" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].fields == ("filter",)


def test_files_scored_before_say_the_rule_abstained_in_noisy_if_only():
    entry = {"name": "gmm", "label": "GMM", "decision": "gmm_noisy", "columns": ["p_clean", "gmm_noisy"],
             "noisy_if": "abstains: the two components overlap (Ashman's D 1.51 < 2)", "threshold": None, "options": {}}
    (record,) = recorded_rules(Provenance.from_json({"rules": [entry]}, "an older file"), ["p_clean", "gmm_noisy"])
    assert record.abstains == "the two components overlap (Ashman's D 1.51 < 2)"
    assert record.value_columns == ["p_clean"]


def test_the_report_draws_no_boundary_and_no_clean_label_for_an_abstaining_gmm(abstaining, tmp_path, capsys):
    import base64
    import re

    scores, truth, _ = abstaining
    report = tmp_path / "r.html"
    assert run_cli(["report", scores, "--truth", truth, "--out", report, "--gallery", "4", "--contrast", "2"],
                   capsys)[0] == 0
    html = report.read_text()
    svgs = " ".join(base64.b64decode(m).decode() for m in re.findall(r"data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)", html))
    assert "GMM boundary" not in svgs and "GMM clean component" not in svgs
    assert "GMM: clean" not in html and "GMM: noisy" not in html and "GMM: abstains" in html
    assert "the GMM rule abstains on these scores" in html


def test_evaluate_reports_no_calibration_for_an_abstaining_rule(abstaining, capsys):
    scores, truth, _ = abstaining
    code, out, _ = run_cli(["evaluate", "detection", scores, "--truth", truth], capsys)
    assert code == 0 and "none: the rule abstains" in out
    result = json.loads(scores.with_name(f"s.detection.{truth.stem}.json").read_text())
    assert result["rules"]["gmm"]["ece"] is None and result["rules"]["gmm"]["abstains"]


def test_score_prints_the_random_pairing_share_by_its_name(abstaining):
    scores, _, out = abstaining
    summary = read_summary(scores)
    low, high = summary.random_pairing_share_low, summary.random_pairing_share_high
    assert 0 <= low <= summary.random_pairing_share <= high <= 1
    assert "pairs like random pairings" in out and f"{summary.random_pairing_share:.1%}" in out
    assert not any("noise_share" in r.notes for r in summary.rules)


def test_estimated_shares_stay_within_0_and_100_percent(tmp_path):
    """The sweep once printed "est. clean kept 142.9%": with the random-pairing share over-estimated
    (15% of the pairs far below the null's median count twice), (kept - noise kept) / (1 - pi0) > 1."""
    from pairclean.curate.sweep import threshold_sweep
    from pairclean.scorefile.db import ScoresDB

    n = 1000
    sim = np.where(np.arange(n) < 150, -0.5, 0.9).astype(np.float32)
    path = tmp_path / "s.parquet"
    pq.write_table(pa.table({"key": [str(i) for i in range(n)], "shard": ["a.tar"] * n, "index": np.arange(n),
                             "sim": sim}), path)
    null = np.random.default_rng(0).normal(0.0, 0.1, 20000)
    with ScoresDB(path) as db:
        sweep = threshold_sweep(db, np.quantile(null, np.linspace(0, 1, 1001)).tolist())
    assert sweep.random_pairing_share == pytest.approx(0.3)
    assert max(r.clean_kept for r in sweep.rows) == 1.0  # (0.85 - 0.3 x 0.01) / 0.7 = 1.21 before
    for row in sweep.rows:
        assert all(0.0 <= v <= 1.0 for v in (row.null_above, row.kept, row.precision, row.clean_kept, row.noise_caught))


def test_evaluate_detection_replaces_its_metrics_only_with_overwrite(abstaining, capsys):
    """README: an existing output is replaced only with --overwrite. Before: SCORES.detection.json
    was replaced by every run."""
    scores, truth, _ = abstaining
    metrics = scores.with_name(f"s.detection.{truth.stem}.json")
    assert run_cli(["evaluate", "detection", scores, "--truth", truth], capsys)[0] == 0
    metrics.write_text("{}")  # an earlier result, kept by a run without --overwrite
    code, _, err = run_cli(["evaluate", "detection", scores, "--truth", truth], capsys)
    assert code == 2 and "exists; pass --overwrite to replace it" in err and metrics.read_text() == "{}"
    code, _, err = run_cli(["evaluate", "detection", scores, "--truth", truth, "--overwrite"], capsys)
    assert code == 0 and json.loads(metrics.read_text())["rules"]


def test_the_gmm_abstains_on_an_estimator_at_chance(tmp_path, capsys):
    """Issue 55: image-label toy pairs scored by a random model (ROC-AUC about 0.5): the mixture
    split the similarities' own modes and the GMM rule flagged 83% of the pairs (41% in the
    issue's run); the null model (random pairings of the same data) says its clean calls are no
    more frequent among the pairs than among random pairings, and it abstains."""
    pairs = tmp_path / "pairs"
    assert run_cli(["synth", "toy-pairs", "image-label", "--out", pairs, "--pairs", "400", "--noise", "0.3"],
                   capsys)[0] == 0
    code, out, err = run_cli(["score", pairs, "--out", tmp_path / "s.parquet", "--model", "pairclean-tiny",
                              "--pretrained", "none", "--workers", "0"], capsys)
    assert code == 0, err
    summary = read_summary(tmp_path / "s.parquet")
    gmm = next(r for r in summary.rules if r.name == "gmm")
    assert gmm.abstains and gmm.abstains.startswith("at chance: clean") and gmm.flagged == 0
    assert "of random pairings" in err
    assert run_cli(["evaluate", "detection", tmp_path / "s.parquet", "--truth", pairs / "truth" / "truth.parquet",
                    "--json", tmp_path / "d.json"], capsys)[0] == 0
    assert 0.35 < json.loads((tmp_path / "d.json").read_text())["roc_auc"] < 0.65  # the estimator is at chance


def test_the_mixtures_clean_calls_are_weighed_against_random_pairings():
    """The check itself: the same mixture decides when random pairings sit in the noisy component
    and abstains when the scored pairs look like random pairings."""
    from pairclean.core.mixture import fit_similarity_mixture, mixture_separation

    rng = np.random.default_rng(0)
    data = np.concatenate([rng.normal(0.1, 0.05, 1000), rng.normal(0.6, 0.05, 1000)])
    mixture = fit_similarity_mixture(data)
    assert mixture_separation(mixture, rng.normal(0.1, 0.05, 1000), data)[1] is None
    measures, why = mixture_separation(mixture, rng.choice(data, 1000), data)  # pairings like the pairs
    assert why and why.startswith("at chance") and abs(measures["clean_share"] - measures["null_clean_share"]) < 0.1
