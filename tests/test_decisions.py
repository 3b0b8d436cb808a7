"""Decisions users can trust (issue 16): the null sample both producers draw, the null-calibrated
FDR rule (p-values, Benjamini-Hochberg q-values), the GMM rule that abstains when its mixture does
not separate, and the calibration (ECE) of p_clean."""

from __future__ import annotations

import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pairclean.cli import main
from pairclean.core.null import NullCalibration
from pairclean.core.scorer import null_partners
from pairclean.data.dataset import open_dataset
from pairclean.scorefile.contract import read_provenance, read_summary
from pairclean.scorefile.evaluation import expected_calibration_error
from pairclean.scorefile.rules import FitContext, parse_rule
from pairclean.data.embeddings import write_embeddings
from pairclean.scoring.model import score

DIM, PAIRS = 16, 600


def _embeddings(directory, noisy_every: int = 4, seed: int = 0) -> np.ndarray:
    """Clean pairs (right = left + a little noise) and every `noisy_every`-th right replaced by
    another row's right (random-pairing noise); returns the truth."""
    rng = np.random.default_rng(seed)
    left = rng.standard_normal((PAIRS, DIM))
    right = left + 0.6 * rng.standard_normal((PAIRS, DIM))
    noisy = np.arange(PAIRS) % noisy_every == 0
    right[noisy] = right[rng.permutation(np.flatnonzero(~noisy))[:noisy.sum()]]
    write_embeddings(directory, [(left.astype(np.float32), right.astype(np.float32), [f"k{i}" for i in range(PAIRS)])])
    return noisy


def _bh(p: np.ndarray) -> np.ndarray:
    """Benjamini-Hochberg q-values, the textbook way: sort, p * N / rank, running minimum from the top."""
    order = np.argsort(p)
    ranked = p[order] * len(p) / np.arange(1, len(p) + 1)
    q = np.minimum(np.minimum.accumulate(ranked[::-1])[::-1], 1.0)
    out = np.empty_like(q)
    out[order] = q
    return out


def test_null_partners_is_a_fixed_derangement():
    for n in (2, 3, 10, 257):
        partners = null_partners(n)
        assert sorted(partners) == list(range(n)) and not (partners == np.arange(n)).any()
    assert len(null_partners(1)) == 0


def test_p_values_count_the_null_at_or_above_with_the_plus_one():
    cal = NullCalibration.fit(np.array([0.1, 0.2, 0.2, 0.3]), np.array([0.25]))
    np.testing.assert_allclose(cal.p_values(np.array([0.35, 0.3, 0.25, 0.2, 0.0])), [1 / 5, 2 / 5, 2 / 5, 4 / 5, 1.0])


def test_q_values_are_benjamini_hochberg_when_the_sample_holds_every_pair():
    rng = np.random.default_rng(1)
    null = rng.normal(0.1, 0.1, 2000)
    sim = np.concatenate([rng.normal(0.1, 0.1, 300), rng.normal(0.45, 0.1, 700)])
    cal = NullCalibration.fit(null, sim)
    np.testing.assert_allclose(cal.q_values(sim), _bh(cal.p_values(sim)), rtol=1e-12)
    cut = cal.cut(0.05)
    assert ((cal.q_values(sim) > 0.05) == (sim <= cut)).all()


def test_random_pairing_share_estimate_covers_the_truth_for_random_pairing_noise():
    rng = np.random.default_rng(2)
    null = rng.normal(0.1, 0.1, 20000)
    sim = np.concatenate([rng.normal(0.1, 0.1, 3000), rng.normal(0.6, 0.1, 7000)])
    estimate, low, high = NullCalibration.fit(null, sim).random_pairing_share(sim)
    assert low <= 0.3 <= high and high - low < 0.05 and estimate == pytest.approx(0.3, abs=0.02)


def test_embeddings_run_draws_the_null_and_the_fdr_rule_keeps_a_bounded_share_of_noise(tmp_path, capsys):
    noisy = _embeddings(tmp_path / "emb")
    scores = tmp_path / "s.parquet"
    main(["score", str(tmp_path / "emb"), "--from-embeddings", "--out", str(scores), "--beta-mode", "fixed",
          "--beta", "0.1", "--rule", "fdr:alpha=0.05"])
    provenance, summary = read_provenance(scores), read_summary(scores)
    assert provenance.null_sample == PAIRS  # every row drew one null pair (one batch, below the per-batch cap)
    table = pq.read_table(scores).to_pydict()
    q, flagged, sim = (np.array(table[c], dtype=float) for c in ("q_null", "fdr_noisy", "sim"))
    flagged = flagged.astype(bool)
    assert (flagged == (q > 0.05)).all()
    kept = ~flagged
    assert kept.sum() > 0.6 * PAIRS and noisy[kept].mean() <= 0.05  # the share of noise among the kept
    fdr = next(r for r in summary.rules if r.name == "fdr")
    assert summary.random_pairing_share_low <= noisy.mean() <= summary.random_pairing_share_high
    cut = provenance.rules[2].threshold
    assert fdr.noisy_if == f"q > 0.05 (sim <= {cut:.4f})" and (flagged == (sim <= np.float32(cut))).all()


def test_model_run_draws_the_null_from_its_batches_and_a_resume_draws_the_same(coco_shards, fast_config, tmp_path):
    from dataclasses import replace

    cfg = replace(fast_config, rules=("beta", "gmm", "fdr"))
    first = score(open_dataset(str(coco_shards)), tmp_path / "a.parquet", cfg)
    again = score(open_dataset(str(coco_shards)), tmp_path / "b.parquet", cfg)
    assert read_provenance(first.out).null_sample == 16  # batches of 8 within shards of 6, 6, 4: all draw
    a, b = pq.read_table(first.out), pq.read_table(again.out)
    assert a.column("p_null").equals(b.column("p_null")) and a.column("q_null").equals(b.column("q_null"))
    p = np.array(a.column("p_null").to_pylist())
    assert ((p > 0) & (p <= 1)).all()


def _bimodal(rng, noise: float, n: int = 4000) -> np.ndarray:
    k = int(noise * n)
    return np.concatenate([rng.normal(0.1, 0.08, k), rng.normal(0.6, 0.08, n - k)])


def test_gmm_separates_random_pairing_noise():
    rng = np.random.default_rng(3)
    rule = parse_rule("gmm")
    rule.fit(_bimodal(rng, 0.3), FitContext(beta=0.2, null_sample=rng.normal(0.1, 0.08, 4000)))
    assert rule.noisy_if() == "p_clean < 0.5" and rule.notes()["separates"]
    assert rule.derive(np.array([0.05, 0.7]))["gmm_noisy"].tolist() == [True, False]


def test_gmm_abstains_when_its_noisy_component_is_far_from_random_pairings(caplog):
    """Hard noise: one broad hump far above the null; the mixture splits the clean pairs."""
    rng = np.random.default_rng(4)
    sample = np.concatenate([rng.normal(0.45, 0.08, 1600), rng.normal(0.65, 0.08, 2400)])
    rule = parse_rule("gmm")
    with caplog.at_level(logging.WARNING, logger="pairclean"):
        rule.fit(sample, FitContext(beta=0.2, null_sample=rng.normal(0.1, 0.08, 4000)))
    assert rule.noisy_if().startswith("abstains: ") and not rule.notes()["separates"]
    assert not rule.derive(sample)["gmm_noisy"].any()
    assert "GMM rule abstains" in caplog.text


def test_gmm_abstains_on_one_hump_without_a_null():
    rng = np.random.default_rng(5)
    rule = parse_rule("gmm")
    rule.fit(rng.normal(0.5, 0.1, 4000), FitContext(beta=0.2))
    assert "Ashman's D" in rule.noisy_if() and not rule.derive(np.array([0.0]))["gmm_noisy"].any()


def test_an_abstaining_gmm_reaches_the_summary_and_flags_nothing(tmp_path, capsys):
    _embeddings(tmp_path / "emb", noisy_every=10 ** 6)  # one noisy pair: nothing for the mixture to separate
    scores = tmp_path / "s.parquet"
    main(["score", str(tmp_path / "emb"), "--from-embeddings", "--out", str(scores), "--beta-mode", "fixed",
          "--beta", "0.1", "--rule", "fdr"])
    captured = capsys.readouterr()
    gmm = next(r for r in read_summary(scores).rules if r.name == "gmm")
    assert gmm.flagged == 0 and gmm.noisy_if.startswith("abstains: ") and gmm.notes["separates"] is False
    assert "GMM rule abstains" in captured.out + captured.err


def test_ece_is_zero_when_calibrated_and_the_gap_when_not():
    clean = np.array([True] * 8 + [False] * 2)
    assert expected_calibration_error(clean, np.full(10, 0.8)) == pytest.approx(0.0)
    assert expected_calibration_error(clean, np.full(10, 1.0)) == pytest.approx(20.0)
    assert expected_calibration_error(clean, np.full(10, np.nan)) is None


def test_evaluate_detection_prints_the_ece_of_p_clean(tmp_path, capsys):
    noisy = _embeddings(tmp_path / "emb")
    truth = tmp_path / "truth.parquet"
    pq.write_table(pa.table({"key": [f"k{i}" for i in range(PAIRS)], "noisy": noisy}), truth)
    scores = tmp_path / "s.parquet"
    main(["score", str(tmp_path / "emb"), "--from-embeddings", "--out", str(scores), "--beta-mode", "fixed",
          "--beta", "0.1"])
    capsys.readouterr()
    main(["evaluate", "detection", str(scores), "--truth", str(truth)])
    out = capsys.readouterr().out
    result = json.loads(scores.with_name("s.detection.truth.json").read_text())
    p_clean = np.array(pq.read_table(scores).column("p_clean").to_pylist())
    ece = result["rules"]["gmm"]["ece"]
    assert ece == pytest.approx(expected_calibration_error(~noisy, p_clean))
    assert "ECE of the GMM rule's P(clean)" in out and f"{ece:.2f}" in out


def test_threshold_sweep_estimates_and_the_report(tmp_path, capsys):
    from pairclean.scorefile.db import ScoresDB
    from pairclean.curate.sweep import threshold_sweep

    noisy = _embeddings(tmp_path / "emb")
    scores = tmp_path / "s.parquet"
    main(["score", str(tmp_path / "emb"), "--from-embeddings", "--out", str(scores), "--beta-mode", "fixed",
          "--beta", "0.1"])
    with ScoresDB(scores) as db:
        sweep = threshold_sweep(db, read_provenance(scores).null_quantiles)
    sim = np.array(pq.read_table(scores).column("sim").to_pylist())
    assert sweep.random_pairing_share == pytest.approx(noisy.mean(), abs=0.06)
    for row in sweep.rows:  # the estimates against the truth, on random-pairing noise
        kept = sim > row.threshold
        assert row.kept == pytest.approx(kept.mean())
        assert row.precision == pytest.approx(1 - noisy[kept].mean(), abs=0.05)
        assert row.clean_kept == pytest.approx(kept[~noisy].mean(), abs=0.08)
    report = tmp_path / "report.html"
    main(["report", str(scores), "--out", str(report), "--gallery", "0", "--contrast", "0"])
    html = report.read_text()
    assert "Choosing a threshold" in html and f"sim &gt; {sweep.rows[-1].threshold:.4f}" in html


def test_filter_dry_run_shows_the_threshold_sweep(coco_shards, coco_scores, capsys):
    from pairclean.scorefile.db import ScoresDB
    from pairclean.curate.sweep import threshold_sweep

    with ScoresDB(coco_scores) as db:
        sweep = threshold_sweep(db, read_provenance(coco_scores).null_quantiles)
    capsys.readouterr()
    main(["filter", str(coco_shards), "--scores", str(coco_scores), "--where", "sim > 0", "--dry-run"])
    out = capsys.readouterr().out
    assert "precision" in out and f"sim > {sweep.rows[0].threshold:.4f}" in out
