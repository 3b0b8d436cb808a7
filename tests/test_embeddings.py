"""`pairclean score --from-embeddings`: the three layouts, normalisation, beta sources, resume."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pairclean.scoring import embeddings
from pairclean.cli import main
from pairclean.data.embeddings import open_embeddings, write_embeddings
from pairclean.scoring.embeddings import EmbeddingScoreConfig, random_embeddings_beta, score_embeddings
from pairclean.errors import UserError
from pairclean.scorefile.contract import SCORES_SCHEMA, read_provenance
from pairclean.core.scorer import cosine_similarity
from pairclean.runs import parts_dir_for

DIM = 16


def _pairs(n: int, seed: int = 0, noise: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Unit left vectors and right vectors correlated with them (cosines spread over (-1, 1))."""
    rng = np.random.default_rng(seed)
    left = rng.standard_normal((n, DIM))
    right = left + noise * rng.standard_normal((n, DIM))
    left /= np.linalg.norm(left, axis=1, keepdims=True)
    right /= np.linalg.norm(right, axis=1, keepdims=True)
    return left.astype(np.float32), right.astype(np.float32)


def _chunks(left, right, size, keys=True):
    return [(left[a:a + size], right[a:a + size], [f"k{i}" for i in range(a, min(a + size, len(left)))] if keys else None)
            for a in range(0, len(left), size)]


def _read(path) -> dict:
    return pq.read_table(path).to_pydict()


def _floats(values) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=np.float64)


FIXED = EmbeddingScoreConfig(beta_mode="fixed", beta=0.1)


def test_clip_retrieval_layout_scores_the_cosine_of_each_row_pair(tmp_path):
    left, right = _pairs(300)
    write_embeddings(tmp_path / "emb", [(a.astype(np.float16), b.astype(np.float16), k)
                                        for a, b, k in _chunks(left, right, 128)])
    spec = open_embeddings(str(tmp_path / "emb"))
    assert spec.layout == "clip-retrieval" and [n.rows for n in spec.npy] == [128, 128, 44] and spec.dim == DIM
    res = score_embeddings(spec, tmp_path / "s.parquet", FIXED)
    rows = _read(tmp_path / "s.parquet")
    assert pq.read_schema(tmp_path / "s.parquet").names == SCORES_SCHEMA.names
    assert rows["key"] == [f"k{i}" for i in range(300)]
    assert [s.rsplit("/", 1)[1] for s in rows["shard"]][127:129] == ["img_emb_0.npy", "img_emb_1.npy"]
    assert rows["index"][:3] == [0, 1, 2] and rows["index"][128] == 0
    expected = cosine_similarity(left.astype(np.float16), right.astype(np.float16))
    np.testing.assert_allclose(rows["sim"], expected, atol=1e-5)
    np.testing.assert_allclose(rows["sim_debiased"], np.asarray(rows["sim"]) - 0.1, atol=1e-6)
    assert res.summary.pairs == res.summary.scored == 300 and res.summary.not_unit_left == 0
    prov = read_provenance(tmp_path / "s.parquet")
    assert prov.estimator["backend"] == "precomputed-embeddings" and prov.estimator["dtype"] == ["float16"]
    assert prov.beta_source == "given by the user (beta)" and prov.beta == 0.1
    assert not parts_dir_for(tmp_path / "s.parquet").exists()


def test_numpy_and_parquet_layouts_agree_and_bad_rows_become_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(embeddings, "BLOCK_ROWS", 3)  # many blocks and jobs per batch, on two threads
    monkeypatch.setattr(embeddings, "JOB_ROWS", 7)
    left, right = _pairs(50, seed=1)
    left[3] = 0.0  # a zero vector
    right[7, 2] = np.nan  # a non-finite one
    np.save(tmp_path / "left.npy", left)
    np.save(tmp_path / "right.npy", right)
    pq.write_table(pa.table({"id": [f"n{i}" for i in range(50)]}), tmp_path / "keys.parquet", row_group_size=20)
    lists = [list(map(float, row)) for row in right]
    lists[11] = None  # missing
    lists[12] = lists[12][:-1]  # wrong length
    pq.write_table(pa.table({"id": [f"n{i}" for i in range(50)], "image_emb": [list(map(float, r)) for r in left],
                             "text_emb": lists}), tmp_path / "emb.parquet", row_group_size=20)

    np_spec = open_embeddings([str(tmp_path / "left.npy"), str(tmp_path / "right.npy")], keys=str(tmp_path / "keys.parquet"),
                              key_field="id", pair="image-text")
    pq_spec = open_embeddings(str(tmp_path / "emb.parquet"), left_field="image_emb", right_field="text_emb", key_field="id")
    assert (np_spec.layout, pq_spec.layout, pq_spec.dim) == ("numpy", "parquet-embeddings", DIM)
    # Small units and batches: keys must be sliced from the right row groups of the key file.
    cfg = EmbeddingScoreConfig(beta_mode="fixed", beta=0.0, unit_rows=17, batch_rows=15, threads=2)
    score_embeddings(np_spec, tmp_path / "np.parquet", cfg)
    score_embeddings(pq_spec, tmp_path / "pq.parquet", cfg)
    a, b = _read(tmp_path / "np.parquet"), _read(tmp_path / "pq.parquet")
    assert a["key"] == b["key"] == [f"n{i}" for i in range(50)]
    assert a["index"] == b["index"] == list(range(50))
    errors = {i: e for i, e in enumerate(a["error"]) if e}
    assert errors == {3: "zero-length embedding", 7: "non-finite embedding"}
    pq_errors = {i: e for i, e in enumerate(b["error"]) if e}
    assert pq_errors == {3: "zero-length embedding", 7: "non-finite embedding", 11: "missing right embedding",
                         12: f"right embedding has {DIM - 1} values, expected {DIM}"}
    good = [i for i in range(50) if i not in pq_errors]
    np.testing.assert_allclose(_floats(a["sim"])[good], _floats(b["sim"])[good], atol=1e-6)
    assert all(a["sim"][i] is None and a["weight"][i] == 0 for i in errors)


def test_vectors_that_are_not_unit_length_are_renormalised_with_a_warning(tmp_path, caplog):
    left, right = _pairs(40, seed=2)
    np.save(tmp_path / "l.npy", left)
    np.save(tmp_path / "r.npy", right)
    np.save(tmp_path / "l3.npy", left * 3.0)
    np.save(tmp_path / "r3.npy", right * np.linspace(0.5, 2.0, 40)[:, None].astype(np.float32))
    unit = score_embeddings(open_embeddings([str(tmp_path / "l.npy"), str(tmp_path / "r.npy")]), tmp_path / "u.parquet", FIXED)
    with caplog.at_level(logging.WARNING, logger="pairclean"):  # pairclean's warning channel
        scaled = score_embeddings(open_embeddings([str(tmp_path / "l3.npy"), str(tmp_path / "r3.npy")]),
                                  tmp_path / "x.parquet", FIXED)
    assert "40 left and 39 right vectors were not unit length" in caplog.text
    np.testing.assert_allclose(_read(tmp_path / "u.parquet")["sim"], _read(tmp_path / "x.parquet")["sim"], atol=1e-6)
    assert unit.summary.not_unit_left == 0 and scaled.summary.not_unit_left == 40
    assert read_provenance(tmp_path / "x.parquet").renormalised.max_norm_deviation == pytest.approx(2.0, abs=1e-5)


def test_random_input_beta_is_the_mean_and_std_of_all_cross_cosines(tmp_path):
    rng = np.random.default_rng(3)
    rand_left = rng.standard_normal((70, DIM)).astype(np.float32) + 0.5  # off-centre: beta > 0
    rand_right = rng.standard_normal((70, DIM)).astype(np.float32) + 0.5
    write_embeddings(tmp_path / "rand", _chunks(rand_left, rand_right, 32, keys=False))
    beta = random_embeddings_beta(open_embeddings(str(tmp_path / "rand")), batch_rows=9)
    full = cosine_similarity(rand_left[:, None, :], rand_right[None, :, :])
    assert beta.beta == pytest.approx(float(full.mean()), abs=1e-9)
    assert beta.std == pytest.approx(float(full.std(ddof=1)), abs=1e-9)
    assert beta.k == 70 and beta.beta > 0.1

    left, right = _pairs(60, seed=4)
    write_embeddings(tmp_path / "emb", _chunks(left, right, 60))
    cfg = EmbeddingScoreConfig(random_embeddings=open_embeddings(str(tmp_path / "rand")))
    res = score_embeddings(open_embeddings(str(tmp_path / "emb")), tmp_path / "s.parquet", cfg)
    prov = read_provenance(tmp_path / "s.parquet")
    assert prov.beta_mode == "random-inputs" and prov.beta == pytest.approx(beta.beta)
    assert prov.beta_source.startswith("computed from random-input embeddings supplied by the user")
    assert res.summary.beta_source == prov.beta_source


def test_shuffled_beta_from_embeddings_is_the_mean_off_diagonal_cosine(tmp_path):
    left, right = _pairs(45, seed=5)
    write_embeddings(tmp_path / "emb", _chunks(left, right, 20))
    score_embeddings(open_embeddings(str(tmp_path / "emb")), tmp_path / "s.parquet",
                     EmbeddingScoreConfig(beta_mode="shuffled"))
    full = cosine_similarity(left[:, None, :], right[None, :, :])
    expected = (full.sum() - np.trace(full)) / (45 * 44)
    assert read_provenance(tmp_path / "s.parquet").beta == pytest.approx(float(expected), abs=1e-6)


def test_a_beta_that_cannot_be_had_is_refused_before_anything_is_written(tmp_path):
    left, right = _pairs(10)
    write_embeddings(tmp_path / "emb", _chunks(left, right, 10))
    spec = open_embeddings(str(tmp_path / "emb"))
    with pytest.raises(UserError, match="no model to draw random inputs"):
        score_embeddings(spec, tmp_path / "s.parquet", EmbeddingScoreConfig())
    with pytest.raises(UserError, match="beta_mode fixed needs beta set to a value"):
        score_embeddings(spec, tmp_path / "s.parquet", EmbeddingScoreConfig(beta_mode="fixed"))
    assert not parts_dir_for(tmp_path / "s.parquet").exists() and not (tmp_path / "s.parquet").exists()


def test_layout_problems_are_user_errors(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros((5, 4), np.float32))
    np.save(tmp_path / "b.npy", np.zeros((6, 4), np.float32))
    np.save(tmp_path / "c.npy", np.zeros((5,), np.float32))
    with pytest.raises(UserError, match="do not pair up"):
        open_embeddings([str(tmp_path / "a.npy"), str(tmp_path / "b.npy")])
    with pytest.raises(UserError, match="must be 2-D"):
        open_embeddings([str(tmp_path / "c.npy"), str(tmp_path / "c.npy")])
    with pytest.raises(UserError, match="cannot tell the embeddings layout"):
        open_embeddings(str(tmp_path))
    pq.write_table(pa.table({"key": ["x"], "left_emb": [[1.0, 2.0]]}), tmp_path / "e.parquet")
    with pytest.raises(UserError, match="no column 'right_emb'"):
        open_embeddings(str(tmp_path / "e.parquet"))
    np.save(tmp_path / "f.npy", np.asfortranarray(np.zeros((5, 4), np.float32)))
    with pytest.raises(UserError, match="column-major"):
        open_embeddings([str(tmp_path / "f.npy"), str(tmp_path / "a.npy")])
    pq.write_table(pa.table({"key": ["a", "b"]}), tmp_path / "k.parquet")
    with pytest.raises(UserError, match="has 2 rows but"):
        open_embeddings([str(tmp_path / "a.npy"), str(tmp_path / "a.npy")], keys=str(tmp_path / "k.parquet"))


def test_a_file_cut_short_during_the_run_is_a_failed_unit_that_keeps_its_rows(tmp_path):
    left, right = _pairs(64, seed=8)
    np.save(tmp_path / "l.npy", left)
    np.save(tmp_path / "r.npy", right)
    spec = open_embeddings([str(tmp_path / "l.npy"), str(tmp_path / "r.npy")])
    size = (tmp_path / "r.npy").stat().st_size
    os.truncate(tmp_path / "r.npy", size - 10 * DIM * 4)  # the last 10 rows are gone
    res = score_embeddings(spec, tmp_path / "s.parquet", replace(FIXED, unit_rows=32, batch_rows=8))
    failures = res.summary.unit_failures
    assert len(failures) == 1 and failures[0].unit.endswith("#rows=32-64") and "ended early" in failures[0].reason
    assert res.summary.pairs == failures[0].rows + 32 == 48  # whole batches before the break are kept


def test_batches_are_bounded_and_unit_chunks_cover_every_row_once(tmp_path):
    left, right = _pairs(103, seed=6)
    np.save(tmp_path / "l.npy", left)
    np.save(tmp_path / "r.npy", right)
    spec = open_embeddings([str(tmp_path / "l.npy"), str(tmp_path / "r.npy")])
    spec_left = left
    units = spec.units(40)
    assert [u.rsplit("#rows=", 1)[1] for u in units] == ["0-40", "40-80", "80-103"]
    seen = []
    for unit in units:
        for batch in spec.batches(unit, 16):
            left, right = batch.rows.arrays()
            assert len(batch.index) <= 16 and left.shape == right.shape == (len(batch.index), DIM)
            np.testing.assert_array_equal(left, spec_left[batch.index])
            seen.extend(batch.index.tolist())
    assert seen == list(range(103))


def test_cli_from_embeddings_and_resume_after_a_kill(tmp_path, capsys):
    left, right = _pairs(90, seed=7)
    write_embeddings(tmp_path / "emb", _chunks(left, right, 30))
    args = ["score", str(tmp_path / "emb"), "--from-embeddings", "--beta-mode", "fixed", "--beta", "0.05"]
    with pytest.raises(SystemExit) as exc:
        main(["score", str(tmp_path / "emb"), "--from-embeddings", "--out", str(tmp_path / "no.parquet")])
    assert exc.value.code == 2
    assert "--random-embeddings" in capsys.readouterr().err

    whole = tmp_path / "whole.parquet"
    main(args + ["--out", str(whole)])
    resumed = tmp_path / "resumed.parquet"

    def killed_after_two_units():
        os.environ["PAIRCLEAN_FAULT"] = "committed:2"  # SIGKILL right after the second unit's commit
        main(args + ["--out", str(resumed)])

    child = multiprocessing.get_context("fork").Process(target=killed_after_two_units)
    child.start()
    child.join()
    assert child.exitcode == -signal.SIGKILL and not resumed.exists()
    assert len(list(parts_dir_for(resumed).glob("part-*.done.json"))) == 2
    capsys.readouterr()
    main(args + ["--out", str(resumed)])
    assert "(resumed run)" in capsys.readouterr().out
    a, b = _read(whole), _read(resumed)
    assert a == b and len(a["key"]) == 90
