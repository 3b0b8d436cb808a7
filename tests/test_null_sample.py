"""The null sample (each drawing row's left with another row's right: pairs of the data that do
not belong together) is a function of the data, not of how a run cuts it: the same shards give
the same drawing rows and partners, the same `null_quantiles` and the same "pairs like random
pairings" interval at another batch size, with DataLoader workers, or killed and resumed at
another batch size (issue 55: [96.1, 100] at one batch size, [89.5, 100] at another).

Runs are forked and SIGKILLed right after the output is renamed into place (`finalize-renamed`),
so the parts, which hold `null_sim`, are still beside it.
"""

from __future__ import annotations

import signal
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from helpers import forked, killed_after_first_unit

import pairclean.core.scorer as scorer
from pairclean.data.embeddings import open_embeddings
from pairclean.runs import parts_dir_for
from pairclean.scorefile.contract import read_provenance, read_summary
from pairclean.scoring.embeddings import EmbeddingScoreConfig, score_embeddings
from pairclean.scoring.model import score

RULES = ("beta", "gmm", "fdr:alpha=0.05")


def test_a_units_draw_is_the_same_however_its_rows_are_batched():
    from pairclean.core.scorer import NullDraw, null_keys, null_partners

    rng = np.random.default_rng(0)
    n, size = 1000, 50
    index = np.sort(rng.choice(5000, n, replace=False))  # indices with gaps, as error rows leave
    left, right = rng.standard_normal((n, 8)).astype(np.float32), rng.standard_normal((n, 8)).astype(np.float32)

    def drawn(cuts, as_torch=False):
        draw = NullDraw(size)
        for a, b in zip(cuts[:-1], cuts[1:]):
            u, v = (torch.from_numpy(left[a:b]), torch.from_numpy(right[a:b])) if as_torch else (left[a:b], right[a:b])
            draw.add(np.arange(a, b), index[a:b], u, v)
            assert draw.held < 2 * size + (b - a)  # bounded: never the whole unit
        return draw.column(n)

    whole = drawn([0, n])
    for cuts in ([0, 1, 2, 500, n], list(range(0, n, 7)) + [n], list(range(0, n, 64)) + [n]):
        np.testing.assert_array_equal(drawn(cuts), whole)
        np.testing.assert_array_equal(drawn(cuts, as_torch=True), whole)
    # the `size` rows of least key, each with the right of the one half the draw away, in row order
    rows = np.sort(np.argsort(null_keys(index), kind="stable")[:size])
    expected = np.full(n, np.nan, dtype=np.float32)
    u, v = left[rows], right[rows][null_partners(size)]
    expected[rows] = scorer.cosine_similarity(u, v)  # in float64; the draw's float32 products within rounding
    np.testing.assert_allclose(whole, expected, atol=1e-6)
    expected[rows] = scorer.cosine_from_products(*(np.einsum("ij,ij->i", a, b) for a, b in ((u, v), (u, u), (v, v))))
    np.testing.assert_array_equal(whole, expected)
    one = NullDraw(size)
    one.add(np.arange(1), index[:1], left[:1], right[:1])
    assert np.isnan(one.column(3)).all()  # one row has no partner but itself


def _parts(out: Path) -> dict[tuple[str, int], tuple[float | None, float | None]]:
    """(shard name, index) -> (sim, null_sim) of every row of the run's parts."""
    found = {}
    for part in sorted(parts_dir_for(out).glob("part-*.parquet")):
        for row in pq.read_table(part).to_pylist():
            found[(Path(row["shard"]).name, row["index"])] = (row["sim"], row["null_sim"])
    return found


def _finished(run, out: Path) -> dict:
    """Run to its output, stopped before the parts are removed: what the null sample decides."""
    assert forked(run, "finalize-renamed:1") == -signal.SIGKILL
    table = pq.read_table(out).to_pydict()
    summary = read_summary(out)
    return {"parts": _parts(out), "quantiles": read_provenance(out).null_quantiles, "p_null": table["p_null"],
            "q_null": table["q_null"], "interval": (summary.random_pairing_share, summary.random_pairing_share_low,
                                                    summary.random_pairing_share_high)}


def _same_null(got: dict, want: dict, tolerance: float = 0.0) -> None:
    """The same rows drew, with the same partners: null_sim equal (within `tolerance`: the model's
    own batch rounding, by which `sim` moves too), the same quantiles, interval and fdr columns."""
    assert got["parts"].keys() == want["parts"].keys()
    drew = {k for k, (_, null) in want["parts"].items() if null is not None}
    assert {k for k, (_, null) in got["parts"].items() if null is not None} == drew and len(drew) >= 4
    for k in drew:
        assert got["parts"][k][1] == pytest.approx(want["parts"][k][1], abs=tolerance)
    # the provenance rounds the quantiles to 6 decimals: a shift of an ulp can move the last one
    assert got["quantiles"] == pytest.approx(want["quantiles"], abs=1.1e-6 if tolerance else 0.0)
    assert got["interval"] == want["interval"]
    assert got["p_null"] == want["p_null"] and got["q_null"] == want["q_null"]


@pytest.mark.parametrize("draw_rows", [None, 3], ids=["every-row", "3-of-each-unit"])
def test_model_runs_draw_the_same_null_at_any_batch_size_with_workers_and_on_resume(
        coco_shards, fast_config, tmp_path, monkeypatch, draw_rows):
    """3 units of 6, 6 and 4 pairs; with 3 drawing rows a unit, the draw also chooses among rows
    that arrive in different batches (the forked runs inherit the patched size)."""
    if draw_rows is not None:
        monkeypatch.setattr(scorer, "NULL_ROWS", draw_rows, raising=False)
    cfg = replace(fast_config, rules=RULES)

    def scored(name: str, run_cfg, resumed_from=None) -> dict:
        out = tmp_path / name / "s.parquet"
        out.parent.mkdir()
        if resumed_from is not None:
            killed_after_first_unit(lambda: score(str(coco_shards), out, resumed_from))
        return _finished(lambda: score(str(coco_shards), out, run_cfg), out)

    reference = scored("b8", cfg)
    tolerance = 2e-7  # the tiny model's sims move by 6e-8 between these batch sizes (one float32 ulp)
    _same_null(scored("b4", replace(cfg, batch_size=4)), reference, tolerance)
    _same_null(scored("b8-w2", replace(cfg, workers=2)), reference, tolerance)  # 2 groups where there was 1
    _same_null(scored("b4-killed-b8", cfg, resumed_from=replace(cfg, batch_size=4)), reference, tolerance)
    # a unit of 6 draws 3 (or all 6), of 4 draws 3 (or all 4)
    per_unit = {}
    for (shard, _), (_, null) in reference["parts"].items():
        per_unit[shard] = per_unit.get(shard, 0) + (null is not None)
    assert sorted(per_unit.values()) == ([4, 6, 6] if draw_rows is None else [3, 3, 3])


DIM = 16


@pytest.fixture(scope="module")
def signal_embeddings(tmp_path_factory) -> Path:
    """600 pairs as two .npy files: clean pairs (right = left + a little noise), every 4th right
    another row's (random-pairing noise), a zero vector and a non-finite one (error rows)."""
    root = tmp_path_factory.mktemp("null-emb")
    rng = np.random.default_rng(1)
    left = rng.standard_normal((600, DIM))
    right = left + 1.5 * rng.standard_normal((600, DIM))
    noisy = np.arange(600) % 4 == 0
    right[noisy] = right[rng.permutation(np.flatnonzero(~noisy))[:noisy.sum()]]
    left[5], right[9, 2] = 0.0, np.nan
    np.save(root / "left.npy", left.astype(np.float32))
    np.save(root / "right.npy", right.astype(np.float32))
    return root


def test_embedding_runs_draw_the_same_null_bit_for_bit_at_any_batch_rows_and_on_resume(
        signal_embeddings, tmp_path, monkeypatch):
    """3 units (250, 250 and 100 rows), 40 drawing rows each: chosen among rows of many batches."""
    monkeypatch.setattr(scorer, "NULL_ROWS", 40, raising=False)
    spec = open_embeddings([str(signal_embeddings / "left.npy"), str(signal_embeddings / "right.npy")])
    cfg = EmbeddingScoreConfig(beta_mode="fixed", beta=0.0, rules=RULES, unit_rows=250, batch_rows=250, threads=1)

    def scored(name: str, run_cfg, resumed_from=None) -> dict:
        out = tmp_path / name / "s.parquet"
        out.parent.mkdir()
        if resumed_from is not None:
            killed_after_first_unit(lambda: score_embeddings(spec, out, resumed_from))
        return _finished(lambda: score_embeddings(spec, out, run_cfg), out)

    reference = scored("whole-units", cfg)
    _same_null(scored("batch-rows-16", replace(cfg, batch_rows=16)), reference)
    _same_null(scored("batch-rows-64-threads-2", replace(cfg, batch_rows=64, threads=2)), reference)
    _same_null(scored("killed-16-resumed-100", replace(cfg, batch_rows=100), resumed_from=replace(cfg, batch_rows=16)),
               reference)
    low, high = reference["interval"][1:]
    assert 0.1 < low < 0.25 < high < 0.45  # random-pairing noise is 1 pair in 4


def test_scoring_saved_embeddings_again_draws_the_models_null(coco_shards, fast_config, tmp_path, monkeypatch):
    """`--from-embeddings` over what `--save-embeddings` wrote (float32: the model's own vectors)
    draws the same rows, with the same partners, as the model run did."""
    monkeypatch.setattr(scorer, "NULL_ROWS", 4, raising=False)
    emb, out = tmp_path / "emb", tmp_path / "m.parquet"
    cfg = replace(fast_config, rules=RULES, save_embeddings=str(emb), embeddings_dtype="float32")
    model = _finished(lambda: score(str(coco_shards), out, cfg), out)
    assert forked(lambda: score(str(coco_shards), out, cfg)) == 0  # finished: the saved directory too
    again = _finished(lambda: score_embeddings(open_embeddings(str(emb)), tmp_path / "e.parquet",
                                               EmbeddingScoreConfig(beta_mode="fixed", beta=0.0, rules=RULES)),
                      tmp_path / "e.parquet")
    nulls = {k: null for k, (_, null) in model["parts"].items() if null is not None}
    assert {k: null for k, (_, null) in again["parts"].items() if null is not None} == pytest.approx(nulls, abs=1e-7)
    assert len(nulls) == 12  # 4 of each unit
