"""`pairclean score --save-embeddings DIR`: the run also writes its embeddings in clip-retrieval's
layout with the model's provenance, each unit's block committed with the unit (a SIGKILLed,
resumed run leaves every embedding exactly once), and `--from-embeddings` scores them again
without a model: same similarities, the recorded beta, the same (shard, index) identity."""

from __future__ import annotations

import json
import signal
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from helpers import forked, run_cli

from pairclean.data.embeddings import open_embeddings
from pairclean.scoring.model import ScoreConfig, score
from pairclean.scorefile.contract import read_provenance

TINY = ScoreConfig(model="pairclean-tiny", pretrained="none", beta_k=64, batch_size=4, workers=0, seed=0,
                   beta_cache=False)


def saved_rows(directory: Path) -> dict[tuple[str, int], tuple[np.ndarray, np.ndarray, str]]:
    """(shard, index) -> (image vector, text vector, key) of every saved row; fails on a repeat."""
    found = {}
    for meta in sorted((directory / "metadata").glob("metadata_*.parquet")):
        number = meta.stem.split("_")[1]
        left = np.load(directory / "img_emb" / f"img_emb_{number}.npy")
        right = np.load(directory / "text_emb" / f"text_emb_{number}.npy")
        table = pq.read_table(meta).to_pylist()
        assert len(table) == len(left) == len(right)
        for row, l, r in zip(table, left, right):
            ident = (row["shard"], row["index"])
            assert ident not in found, f"{ident} saved twice"
            found[ident] = (l, r, row["key"])
    return found


@pytest.fixture(scope="module")
def saved(tmp_path_factory, coco_shards):
    root = tmp_path_factory.mktemp("saved")
    out, emb = root / "scores.parquet", root / "emb"
    result = score(str(coco_shards), out, replace(TINY, save_embeddings=str(emb)))
    return out, emb, result


def test_the_layout_holds_every_scored_pair_once_with_provenance(saved):
    out, emb, result = saved
    scores = {(r["shard"], r["index"]): r for r in pq.read_table(out).to_pylist()}
    rows = saved_rows(emb)
    assert set(rows) == {k for k, r in scores.items() if r["error"] is None} and len(rows) == 16
    for ident, (left, right, key) in rows.items():
        assert left.dtype == np.float16 and key == scores[ident]["key"]
        cosine = float(left.astype(np.float32) @ right.astype(np.float32))
        assert cosine == pytest.approx(scores[ident]["sim"], abs=2e-3)  # fp16 storage
    provenance = json.loads((emb / "provenance.json").read_text())
    assert provenance["estimator"]["model"] == "pairclean-tiny" and provenance["weights_sha1"]
    assert provenance["preprocessing"] and provenance["rows"] == 16 and provenance["dtype"] == "float16"
    assert provenance["beta"]["beta"] == pytest.approx(read_provenance(out).beta)
    assert result.summary.embeddings_saved == 16 and result.summary.embedding_bytes == provenance["bytes"] > 0


def test_from_embeddings_scores_them_again_without_a_model(saved, tmp_path, capsys):
    out, emb, _ = saved
    again = tmp_path / "again.parquet"
    code, printed, err = run_cli(["score", emb, "--from-embeddings", "--out", again, "--rule", "top-fraction:keep=0.5"],
                                 capsys)
    assert code == 0, err
    # The long beta source goes under the summary table instead of padding it (before: ~200 columns).
    summary = printed[printed.index("pairclean score ->"):].splitlines()
    assert max(len(line) for line in summary[:-1]) < 120 and summary[-1].startswith("beta: recorded with the embeddings")
    assert any(line.startswith("time: beta / scoring") and "(see below)" in line for line in summary)
    first = {(r["shard"], r["index"]): r for r in pq.read_table(out).to_pylist() if r["error"] is None}
    second = {(r["shard"], r["index"]): r for r in pq.read_table(again).to_pylist()}
    assert first.keys() == second.keys()  # the dataset's identity, so truth and the first scores join
    for ident, row in first.items():
        assert second[ident]["key"] == row["key"] and second[ident]["sim"] == pytest.approx(row["sim"], abs=2e-3)
    provenance = read_provenance(again)
    assert provenance.beta == pytest.approx(read_provenance(out).beta)  # the recorded random-inputs beta
    assert "recorded with the embeddings" in provenance.beta_source
    assert provenance.estimator["saved_by"]["estimator"]["model"] == "pairclean-tiny"
    # the dataset the saving run scored, recorded with the embeddings: filter finds the pairs from the scores alone
    assert provenance.dataset.pairs == read_provenance(out).dataset
    code, printed, err = run_cli(["filter", again, "--where", "sim > -2", "--out", tmp_path / "kept"], capsys)
    assert code == 0, err
    assert len(list((tmp_path / "kept").glob("*.tar"))) >= 1
    spec = open_embeddings(str(emb))
    assert spec.pair == "image-text" and spec.saved.rows == 16


@pytest.mark.parametrize("fault", ["part-written:2", "committed:3", "before-rename:6"])
def test_a_killed_run_resumes_to_every_embedding_exactly_once(coco_shards, saved, tmp_path, fault):
    _, reference_dir, _ = saved
    out, emb = tmp_path / "s.parquet", tmp_path / "emb"
    cfg = replace(TINY, save_embeddings=str(emb))
    assert forked(lambda: score(str(coco_shards), out, cfg), fault) == -signal.SIGKILL
    assert not (emb / "provenance.json").exists()
    assert forked(lambda: score(str(coco_shards), out, cfg)) == 0
    got, reference = saved_rows(emb), saved_rows(reference_dir)
    assert got.keys() == reference.keys()
    for ident, (left, right, key) in reference.items():  # a resumed run batches alike: the same vectors
        np.testing.assert_array_equal(got[ident][0], left)
        np.testing.assert_array_equal(got[ident][1], right)
    assert not [p for p in emb.rglob("*") if p.name.startswith(".")]  # no temp file left


def test_a_fresh_run_refuses_a_directory_holding_embeddings(coco_shards, saved, tmp_path, capsys):
    _, emb, _ = saved
    before = sorted(p.name for p in emb.rglob("*"))
    code, _, err = run_cli(["score", coco_shards, "--out", tmp_path / "x.parquet", "--model", "pairclean-tiny",
                            "--pretrained", "none", "--beta-k", "16", "--workers", "0", "--save-embeddings", emb], capsys)
    assert code == 2 and "--save-embeddings" in err and "--overwrite" in err
    assert sorted(p.name for p in emb.rglob("*")) == before
    code, _, err = run_cli(["score", emb, "--from-embeddings", "--save-embeddings", tmp_path / "e", "--out",
                            tmp_path / "y.parquet"], capsys)
    assert code == 2 and "--from-embeddings" in err
    code, _, err = run_cli(["score", coco_shards, "--out", tmp_path / "z.parquet", "--save-embeddings",
                            coco_shards], capsys)
    assert code == 2 and "--save-embeddings" in err
