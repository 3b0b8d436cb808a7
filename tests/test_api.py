"""The Python API a notebook calls (docs/api.md): `pairclean.score_embeddings` (arrays in, the
scores file's columns out, computed as `score --from-embeddings` computes them), `open_scores`,
and the package's public names."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pairclean
from helpers import run_cli
from pairclean.errors import ConfigError, UserError

RULES = ("beta", "gmm", "fdr:alpha=0.05")


def _pairs(n: int, dim: int = 8, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Unnormalised pairs, a third of them mismatched, one zero and one non-finite vector."""
    rng = np.random.default_rng(seed)
    left = rng.standard_normal((n, dim)).astype(np.float32) * 3
    right = left + rng.standard_normal((n, dim)).astype(np.float32)
    right[::3] = rng.standard_normal((len(right[::3]), dim))
    left[5] = 0.0
    right[9, 1] = np.inf
    return left, right


def _same(api: pa.Table, cli: pa.Table, columns) -> None:
    for name in columns:
        a, b = api.column(name).to_numpy(zero_copy_only=False), cli.column(name).to_numpy(zero_copy_only=False)
        if a.dtype.kind == "f":
            np.testing.assert_array_equal(a, b, err_msg=name)  # NaN (NULL) in the same rows, equal elsewhere
        else:
            assert a.tolist() == b.tolist(), name


def test_dir_lists_the_public_names_and_import_stays_light():
    assert "score_embeddings" in dir(pairclean) and "open_scores" in dir(pairclean)
    assert set(dir(pairclean)) == set(pairclean.__all__)
    assert all(getattr(pairclean, name) is not None for name in pairclean.__all__)
    printed = subprocess.run([sys.executable, "-c", "import sys, pairclean; dir(pairclean); "
                              "print('torch' in sys.modules)"], capture_output=True, text=True, check=True).stdout
    assert printed.strip() == "False"


def test_train_is_the_function_and_training_its_package():
    """`pairclean.train` is the function, before and after its package (`pairclean.training`) is
    imported (the package was `pairclean.train`: once imported, Python bound it there)."""
    printed = subprocess.run([sys.executable, "-c", "import pairclean, pairclean.training.trainer; "
                              "print(pairclean.train is pairclean.training.train, pairclean.TrainConfig.__name__)"],
                             capture_output=True, text=True, check=True).stdout
    assert printed.split() == ["True", "TrainConfig"]


@pytest.mark.parametrize("beta", [0.1, None], ids=["fixed", "shuffled"])
def test_arrays_and_the_same_arrays_as_two_npy_files_give_equal_columns(tmp_path, capsys, beta):
    """70,000 rows: two batches of the embeddings producer, so the null pairs of both are drawn alike."""
    left, right = _pairs(70_000)
    np.save(tmp_path / "LEFT.npy", left)
    np.save(tmp_path / "RIGHT.npy", right)
    mode = ["--beta-mode", "fixed", "--beta", "0.1"] if beta is not None else ["--beta-mode", "shuffled"]
    code, _, err = run_cli(["score", tmp_path / "LEFT.npy", tmp_path / "RIGHT.npy", "--from-embeddings", *mode,
                            "--rule", "fdr:alpha=0.05", "--out", tmp_path / "s.parquet"], capsys)
    assert code == 0, err
    cli = pq.read_table(tmp_path / "s.parquet")
    api = pairclean.score_embeddings(left, right, beta=beta, rules=RULES)
    assert api.column_names == [c for c in cli.column_names if c != "shard"]
    _same(api, cli, ["index", "sim", "sim_debiased", "weight", "weight_norm", "osa_noisy", "p_clean", "gmm_noisy",
                     "p_null", "q_null", "fdr_noisy", "error"])
    assert api.column("error").to_pylist()[5] == "zero-length embedding"
    ours, theirs = pairclean.read_provenance(api), pairclean.read_provenance(tmp_path / "s.parquet")
    assert ours.beta == theirs.beta and ours.beta_mode == theirs.beta_mode
    assert [r.noisy_if for r in ours.rules] == [r.noisy_if for r in theirs.rules]
    summary, file_summary = pairclean.read_summary(api), pairclean.read_summary(tmp_path / "s.parquet")
    assert (summary.pairs, summary.errors, summary.flagged) == (file_summary.pairs, file_summary.errors,
                                                               file_summary.flagged)
    assert summary.random_pairing_share == file_summary.random_pairing_share


def test_torch_tensors_and_keys(tmp_path):
    import torch

    left, right = _pairs(300, seed=1)
    from_numpy = pairclean.score_embeddings(left, right, beta=0.2)
    from_torch = pairclean.score_embeddings(torch.from_numpy(left), torch.from_numpy(right), beta=0.2,
                                            keys=[f"k{i}" for i in range(300)])
    _same(from_numpy, from_torch, ["sim", "weight", "osa_noisy", "gmm_noisy"])
    assert from_torch.column("key").to_pylist()[:2] == ["k0", "k1"] and from_numpy.column("key")[1].as_py() == "1"
    half = pairclean.score_embeddings(torch.from_numpy(left).bfloat16(), torch.from_numpy(right).half(), beta=0.2)
    np.testing.assert_allclose(half.column("sim").to_numpy(zero_copy_only=False),
                               from_numpy.column("sim").to_numpy(zero_copy_only=False), atol=2e-2)


@pytest.mark.parametrize("args, field", [
    ((np.zeros(4), np.zeros(4)), "left"),
    ((np.zeros((4, 3)), np.zeros((4, 2))), "left"),
    ((np.zeros((4, 3), dtype=np.int64), np.zeros((4, 3))), "left"),
    ((np.zeros((4, 3)), np.zeros((0, 3))), "right"),
])
def test_arrays_that_are_not_two_n_by_d_float_arrays_are_refused_naming_them(args, field):
    with pytest.raises(ConfigError) as caught:
        pairclean.score_embeddings(*args, beta=0.1)
    assert f"`{field}`" in str(caught.value) and field in caught.value.fields


@pytest.mark.parametrize("options, field", [({"weight_fn": "square"}, "weight_fn"), ({"rules": ["nope"]}, "rules"),
                                            ({"beta": float("nan")}, "beta"), ({"seed": -1}, "seed"),
                                            ({"keys": ["a"]}, "keys")])
def test_settings_are_checked_as_the_scoring_run_checks_them(options, field):
    left, right = _pairs(20)
    with pytest.raises(ConfigError) as caught:
        pairclean.score_embeddings(left, right, **{"beta": 0.1, **options})
    assert field in caught.value.fields


def test_open_scores_queries_filters_and_reads_the_records(tmp_path, coco_scores, coco_shards):
    with pairclean.open_scores(coco_scores) as scores:
        assert scores.summary.pairs == 16 and scores.provenance.beta == scores.summary.beta
        assert {"sim", "weight", "gmm_noisy"} <= set(scores.columns)
        assert scores.query("SELECT count(*) AS n FROM scores").column("n").to_pylist() == [16]
        kept = scores.table(where="NOT osa_noisy", columns=["key", "sim"])
        assert kept.column_names == ["key", "sim"]
        assert kept.num_rows == scores.query("SELECT * FROM scores WHERE NOT osa_noisy").num_rows
        assert scores.to_arrow().num_rows == 16
        with pytest.raises(UserError, match="read-only"):
            scores.query("DELETE FROM scores")
        with pytest.raises(ConfigError, match="bad `where` predicate"):
            scores.table(where="sim +")
        dry = scores.filter(where="NOT osa_noisy", dry_run=True)
        assert dry.kept_pairs == kept.num_rows and dry.total_pairs == 16
        written = scores.filter(tmp_path / "kept", where="NOT osa_noisy")
        assert written.kept_pairs == kept.num_rows and (tmp_path / "kept" / "manifest.yaml").is_file()
        # the filter ran in a session of its own: this one still sees every row
        assert scores.to_arrow().num_rows == 16


REPO = Path(__file__).resolve().parents[1]
IMG2DATASET = REPO / "tests" / "data" / "ecosystem" / "img2dataset" / "webdataset"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(doc: Path) -> list[str]:
    return PYTHON_BLOCK.findall(doc.read_text())


@pytest.mark.parametrize("doc", ["README.md", "docs/api.md"])
def test_every_python_block_of_the_docs_runs(doc, tmp_path, monkeypatch):
    """Each fenced python block, in order, in a fresh namespace, in a directory holding img2dataset's
    own output as `img2dataset-out/`. The model is swapped for the tiny offline one (the blocks'
    code runs as written; their figures are the tiny model's)."""
    import pairclean.scoring.model as model
    import pairclean.training as training

    score_config, train_config = model.ScoreConfig, training.TrainConfig
    monkeypatch.setattr(model, "ScoreConfig", lambda **given: score_config(**{
        **given, "model": "pairclean-tiny", "pretrained": "none", "beta_k": 64, "batch_size": 8, "workers": 0}))
    monkeypatch.setattr(training, "TrainConfig", lambda **given: train_config(**{
        **given, "model": "pairclean-tiny", "pretrained": "none", "workers": 0, "warmup_steps": 1,
        "shuffle_buffer": 8}))
    shutil.copytree(IMG2DATASET, tmp_path / "img2dataset-out")
    monkeypatch.chdir(tmp_path)
    blocks = python_blocks(REPO / doc)
    assert len(blocks) >= 2
    for number, block in enumerate(blocks, 1):
        exec(compile(block, f"{doc}, python block {number}", "exec"), {"__name__": "__main__"})
    assert (tmp_path / "scores.parquet").is_file() and (tmp_path / "clean" / "manifest.yaml").is_file()
