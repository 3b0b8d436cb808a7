"""Decision rules: the registry, the default scores file unchanged, and a rule enabled at score time
(top-fraction) reaching the Parquet, the summary, `evaluate detection` and the report with no code
outside its class naming it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pairclean
from pairclean.cli import main
from pairclean.errors import UserError
from pairclean.scorefile.contract import SCORES_SCHEMA, Provenance, read_provenance, read_summary
from pairclean.scorefile.rules import DEFAULT_RULES, REGISTRY, FitContext, build_rules, parse_rule, recorded_rules
from pairclean.data.embeddings import write_embeddings
from pairclean.scoring.embeddings import EmbeddingScoreConfig
from pairclean.scoring.model import ScoreConfig

DIM, PAIRS, NOISY_EVERY = 16, 400, 4
PACKAGE = Path(pairclean.__file__).parent


def _embeddings(directory: Path) -> list[bool]:
    """Clean pairs (right = left + a little noise) and every 4th pair mismatched (right unrelated);
    returns the truth."""
    rng = np.random.default_rng(0)
    left = rng.standard_normal((PAIRS, DIM))
    right = left + 0.5 * rng.standard_normal((PAIRS, DIM))
    noisy = [i % NOISY_EVERY == 0 for i in range(PAIRS)]
    right[noisy] = rng.standard_normal((sum(noisy), DIM))
    left /= np.linalg.norm(left, axis=1, keepdims=True)
    right /= np.linalg.norm(right, axis=1, keepdims=True)
    write_embeddings(directory, [(left.astype(np.float32), right.astype(np.float32), [f"k{i}" for i in range(PAIRS)])])
    return noisy


def test_default_file_has_todays_columns_in_todays_order():
    assert [(f.name, str(f.type)) for f in SCORES_SCHEMA] == [
        ("key", "string"), ("shard", "string"), ("index", "int64"), ("sim", "float"), ("sim_debiased", "float"),
        ("weight", "float"), ("weight_norm", "float"), ("osa_noisy", "bool"), ("p_clean", "float"),
        ("gmm_noisy", "bool"), ("error", "string")]


def test_top_fraction_fits_the_quantile_of_the_sample():
    rule = parse_rule("top-fraction:keep=0.75")
    sample = np.linspace(0.0, 1.0, 101)
    rule.fit(sample, FitContext(beta=0.1))
    assert rule.threshold() == pytest.approx(0.25) and rule.noisy_if() == "sim <= 0.2500"
    assert rule.derive(np.array([0.2, 0.25, 0.3, np.nan]))["top_fraction_noisy"].tolist() == [True, True, False, False]


@pytest.mark.parametrize("specs, message", [
    (("beta", "nope"), "unknown rule 'nope'"),
    (("top-fraction:keep",), "bad option 'keep'"),
    (("top-fraction:share=0.5",), "bad option 'share=0.5'"),
    (("top-fraction:keep=lots",), "keep must be a number, got 'lots'"),
    (("top-fraction:keep=1.5",), "keep must be within (0, 1]"),
    (("fdr:alpha=0.1,alpha=0.2",), "option alpha is given twice"),  # issue 25: the last one was kept
    (("fdr:alpha=nan",), "alpha must be a finite number"),
    (("fdr:alpha=inf",), "alpha must be a finite number"),
    (("gmm", "gmm"), "rules gmm and gmm both write column p_clean"),
])
def test_bad_rule_specs_fail_before_scoring(specs, message):
    with pytest.raises(UserError, match=re.escape(message)):
        build_rules(specs)
    with pytest.raises(UserError, match=re.escape(message)):
        ScoreConfig(rules=specs)
    with pytest.raises(UserError, match=re.escape(message)):
        EmbeddingScoreConfig(rules=specs)


def test_unknown_rule_on_the_command_line_is_one_line(tmp_path, capsys):
    _embeddings(tmp_path / "emb")
    with pytest.raises(SystemExit) as exit_info:
        main(["score", str(tmp_path / "emb"), "--from-embeddings", "--out", str(tmp_path / "s.parquet"),
              "--rule", "top-fraction:keep=2"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and "keep must be within (0, 1]" in err
    assert not (tmp_path / "s.parquet").exists()


def test_files_without_recorded_rules_hold_the_default_rules_they_have_columns_for():
    rules = recorded_rules(Provenance.from_json({"beta": 0.3}, "an older file"), ["sim", "osa_noisy", "p_clean", "gmm_noisy"])
    assert [(r.name, r.decision, r.noisy_if, r.threshold) for r in rules] == [
        ("beta", "osa_noisy", "sim <= 0.3000", 0.3), ("gmm", "gmm_noisy", "p_clean < 0.5", None)]
    assert [r.name for r in recorded_rules(Provenance(), ["sim", "gmm_noisy"])] == ["gmm"]


def test_an_enabled_rule_reaches_the_file_the_summary_evaluate_and_the_report(tmp_path, capsys):
    noisy = _embeddings(tmp_path / "emb")
    truth = tmp_path / "truth.parquet"
    pq.write_table(pa.table({"key": [f"k{i}" for i in range(PAIRS)], "noisy": noisy}), truth)
    scores = tmp_path / "scores.parquet"
    main(["score", str(tmp_path / "emb"), "--from-embeddings", "--out", str(scores), "--beta-mode", "fixed",
          "--beta", "0.1", "--rule", "top-fraction:keep=0.7"])
    cut = read_provenance(scores).rules[2].threshold
    out = capsys.readouterr().out  # the summary table (rich wraps its rows at 80 columns)
    assert "flagged by top-fraction rule (sim <=" in out and f"{cut:.4f})" in out

    # The file: the default columns, then the rule's, then error; 30% flagged below the fitted cut.
    assert pq.read_schema(scores).names == [*SCORES_SCHEMA.names[:-1], "top_fraction_noisy", "error"]
    table = pq.read_table(scores).to_pydict()
    flagged = np.array(table["top_fraction_noisy"])
    assert flagged.tolist() == (np.array(table["sim"]) <= np.float32(cut)).tolist()
    assert flagged.mean() == pytest.approx(0.3, abs=0.01)
    summary = read_summary(scores)
    assert summary.flagged["top-fraction"] == flagged.sum() and [r.name for r in summary.rules] == [
        "beta", "gmm", "top-fraction"]
    assert summary.share_flagged["gmm"] == pytest.approx(np.mean(table["gmm_noisy"]))
    metadata = json.loads(pq.read_metadata(scores).metadata[b"pairclean_summary"])  # the file's keys stay
    assert metadata["flagged_top-fraction"] == flagged.sum() and metadata["share_flagged_gmm"] == summary.share_flagged["gmm"]
    assert read_provenance(scores).rules[2].options == {"keep": 0.7}

    # evaluate detection: its row, with the metrics of the column against the truth.
    main(["evaluate", "detection", str(scores), "--truth", str(truth)])
    out = capsys.readouterr().out
    assert re.search(rf"top-fraction\s+sim <= {cut:.4f}", out)
    result = json.loads(scores.with_name(f"scores.detection.{truth.stem}.json").read_text())
    truth_noisy = np.array(noisy)
    assert result["rules"]["top-fraction"]["noise_caught"] == pytest.approx(
        100 * (flagged & truth_noisy).sum() / truth_noisy.sum())
    assert set(result["rules"]) == {"beta", "gmm", "top-fraction", "oracle"}

    # The report: its card and its row of the truth table, with the same figures as evaluate.
    report = tmp_path / "report.html"
    main(["report", str(scores), "--out", str(report), "--truth", str(truth), "--gallery", "0", "--contrast", "0"])
    html = report.read_text()
    assert "flagged by top-fraction rule" in html and "<th>flagged top-fraction</th>" in html
    m = result["rules"]["top-fraction"]
    assert (f"<tr><td>top-fraction</td><td>sim &lt;= {cut:.4f}</td><td>{m['flagged']:,}</td>"
            f"<td>{m['clean_kept'] / 100:.1%}</td><td>{m['noise_caught'] / 100:.1%}</td>") in html


@pytest.mark.parametrize("module", ["scoring/finalize.py", "curate/report/__init__.py", "curate/report/stats.py",
                                    "curate/report/figures.py", "curate/report/page.py", "curate/report/page.html",
                                    "scorefile/evaluation.py", "scorefile/contract.py", "cli/evaluate.py", "cli/score.py",
                                    "lab/demo.py"])
def test_no_code_outside_the_registry_names_a_rule(module):
    """Every rule's decision column, and anything of the rules added beyond the defaults (name,
    columns), appear only in the registry (`grep` finds them nowhere else)."""
    source = (PACKAGE / module).read_text()
    words = {rule.decision for rule in REGISTRY.values()}
    for name in set(REGISTRY) - set(DEFAULT_RULES):
        words |= {name, name.replace("-", "_"), *(column for column, _ in REGISTRY[name].columns)}
    assert [word for word in sorted(words) if word in source] == []
