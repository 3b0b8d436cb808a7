"""`pairclean score` end to end on real COCO JPEGs, with the tiny randomly initialised open_clip model."""

from __future__ import annotations

import json
import shutil

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import exit_code as _cli

from pairclean.cli import main
from pairclean.lab.coco import read_pairs
from pairclean.scorefile.contract import read_provenance, run_manifest_path
from pairclean.scoring.model import score
from pairclean.runs import parts_dir_for


def _rows(path):
    return pq.read_table(path).to_pylist()


def test_shards_and_parquet_score_one_row_per_input_pair(coco_src, coco_shards, coco_parquet, fast_config, tmp_path):
    pairs = read_pairs(coco_src)
    out_wds = tmp_path / "wds.parquet"
    out_pq = tmp_path / "pq.parquet"
    res = score(str(coco_shards), out_wds, fast_config)
    score(str(coco_parquet), out_pq, fast_config)
    wds_rows, pq_rows = _rows(out_wds), _rows(out_pq)
    assert [r["key"] for r in wds_rows] == [p["key"] for p in pairs]
    assert [r["key"] for r in pq_rows] == [p["key"] for p in pairs]
    assert [(r["shard"].rsplit("/", 1)[1], r["index"]) for r in wds_rows] == \
        [(f"coco-mini-{i // 6:06d}.tar", i % 6) for i in range(len(pairs))]
    assert all(r["error"] is None for r in wds_rows + pq_rows)
    # Same images, same captions, same model: the two source formats give the same similarities.
    np.testing.assert_allclose([r["sim"] for r in wds_rows], [r["sim"] for r in pq_rows], atol=1e-6)
    assert res.summary.pairs == res.summary.scored == len(pairs)
    assert not parts_dir_for(out_wds).exists()  # parts are removed once the output is final


def test_derived_columns_follow_the_scorer(coco_shards, fast_config, tmp_path):
    out = tmp_path / "s.parquet"
    score(str(coco_shards), out, fast_config)
    prov = read_provenance(out)
    beta = prov.beta
    for r in _rows(out):
        s_tilde = r["sim"] - beta
        assert r["sim_debiased"] == pytest.approx(s_tilde, abs=1e-6)
        assert r["weight"] == pytest.approx(max(s_tilde, 0) ** 2 * (1 - max(s_tilde, 0)), abs=1e-6)
        assert r["weight_norm"] == pytest.approx(min(r["weight"] / (4 / 27), 1.0), abs=1e-5)
        assert r["osa_noisy"] == (s_tilde <= 0)
        assert r["gmm_noisy"] == (r["p_clean"] is not None and r["p_clean"] < 0.5)  # NULL: the rule abstains
    assert prov.estimator["model"] == "pairclean-tiny" and prov.weight_fn == "cubic"
    assert prov.beta_k == 64 and prov.beta_std > 0 and prov.seed == 0
    manifest = json.loads(run_manifest_path(out).read_text())
    assert manifest["provenance"]["beta"] == beta and manifest["summary"]["pairs"] == 16


def test_same_seed_gives_identical_beta_and_scores(coco_shards, fast_config, tmp_path):
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    score(str(coco_shards), a, fast_config)
    score(str(coco_shards), b, fast_config)
    assert read_provenance(a).beta == read_provenance(b).beta
    assert pq.read_table(a).equals(pq.read_table(b))


def test_duckdb_reads_the_output_directly(coco_shards, fast_config, tmp_path):
    out = tmp_path / "scores.parquet"
    score(str(coco_shards), out, fast_config)
    n, flagged, n_keys = duckdb.connect().execute(
        f"SELECT count(*), count(*) FILTER (WHERE p_clean < 0.5), count(DISTINCT key) FROM '{out}'").fetchone()
    assert n == 16 and n_keys == 16 and 0 <= flagged <= 16


def test_parquet_with_image_paths_and_custom_columns(coco_src, tmp_path, fast_config):
    data = tmp_path / "data"
    shutil.copytree(coco_src, data)
    pairs = read_pairs(data)
    table = pa.table({"id": [p["key"] for p in pairs], "img": [p["image"] for p in pairs],
                      "alt": [p["caption"] for p in pairs]})
    pq.write_table(table, data / "pairs.parquet", row_group_size=5)
    out = tmp_path / "s.parquet"
    code = _cli(["score", str(data / "pairs.parquet"), "--out", str(out), "--model", "pairclean-tiny",
                 "--pretrained", "none", "--beta-k", "32", "--workers", "0", "--batch-size", "4",
                 "--image-path-field", "img", "--text-field", "alt", "--key-field", "id"])
    assert code == 0
    rows = _rows(out)
    assert [r["key"] for r in rows] == [p["key"] for p in pairs]
    assert [r["index"] for r in rows] == list(range(16)) and all(r["error"] is None for r in rows)


def _one_line_error(capsys, argv, expect):
    code = _cli(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and expect in err and "Traceback" not in err
    return err


TINY = ["--model", "pairclean-tiny", "--pretrained", "none", "--beta-k", "16", "--workers", "0"]


def test_bad_input_is_one_line_exit_2_and_writes_nothing(coco_shards, tmp_path, capsys):
    out = tmp_path / "s.parquet"
    _one_line_error(capsys, ["score", str(tmp_path / "missing"), "--out", str(out), *TINY], "not found")
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_error(capsys, ["score", str(empty), "--out", str(out), *TINY], "no shards")
    _one_line_error(capsys, ["score", str(coco_shards), "--out", str(out), "--model", "ViT-Nope"], "unknown model")
    _one_line_error(capsys, ["score", str(coco_shards), "--out", str(out), "--model", "pairclean-tiny",
                             "--pretrained", "openai"], "--pretrained")
    assert not out.exists() and not parts_dir_for(out).exists()
    out.write_bytes(b"precious")
    _one_line_error(capsys, ["score", str(coco_shards), "--out", str(out), *TINY], "--overwrite")
    assert out.read_bytes() == b"precious"


def test_unreadable_parquet_columns_are_reported(coco_parquet, tmp_path, capsys):
    """A column the first file lacks is named before any model is built (issue 56); one that a later
    file lacks fails that file's units with the column named, and the run reports them (issue 15)."""
    out = tmp_path / "s.parquet"
    err = _one_line_error(capsys, ["score", str(coco_parquet), "--out", str(out), *TINY, "--text-field", "nope"],
                          "no column 'nope' for the captions (name it with --text-field; its text columns: caption)")
    assert not run_manifest_path(out).exists()
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(coco_parquet, data / "a.parquet")
    table = pq.read_table(coco_parquet)
    pq.write_table(table.rename_columns(["key", "text", "image"]), data / "b.parquet")
    code = _cli(["score", str(data), "--out", str(out), *TINY])
    assert code == 0, capsys.readouterr().err
    failures = json.loads(run_manifest_path(out).read_text())["summary"]["unit_failures"]
    assert len(failures) == 1 and "column(s) ['caption'] not in" in failures[0]["reason"], failures


def test_pretrained_tag_without_network_suggests_local_path(coco_shards, tmp_path, capsys, monkeypatch):
    import open_clip.factory

    def offline(*args, **kwargs):
        raise RuntimeError("Failed to download file (openai): no network")

    monkeypatch.setattr(open_clip.factory, "download_pretrained", offline)
    _one_line_error(capsys, ["score", str(coco_shards), "--out", str(tmp_path / "s.parquet"), "--model", "ViT-B-32",
                             "--pretrained", "openai"], "--pretrained none")


def test_local_checkpoint_loads_through_open_clip_and_is_hashed(coco_shards, tmp_path, fast_config):
    import open_clip
    import torch

    from pairclean.backends.base import file_sha256
    from pairclean.backends.open_clip import register_model_configs

    register_model_configs()
    torch.manual_seed(1)
    model = open_clip.create_model("pairclean-tiny")
    ckpt = tmp_path / "tiny.pt"
    torch.save(model.state_dict(), ckpt)
    fast_config.pretrained = str(ckpt)
    out = tmp_path / "s.parquet"
    score(str(coco_shards), out, fast_config)
    prov = read_provenance(out).estimator
    assert prov["checkpoint_sha256"] == file_sha256(ckpt)


def test_shards_smaller_than_half_a_batch_are_pointed_out(coco_src, fast_config, tmp_path, caplog, capsys):
    import logging
    from dataclasses import replace

    from pairclean.ops import notices
    from pairclean.lab.coco import build_shards

    shards = tmp_path / "small"
    build_shards(coco_src, shards, shard_size=3)  # 6 shards of at most 3 pairs
    notices._said.discard("small-shards")  # said at most once per process
    with caplog.at_level(logging.WARNING, logger="pairclean"):
        score(str(shards), tmp_path / "a.parquet", replace(fast_config, batch_size=4))
    assert "the shards hold" not in caplog.text  # 2.7 pairs per shard fill most of a 4-pair batch
    main(["score", str(shards), "--out", str(tmp_path / "b.parquet"), "--model", "pairclean-tiny",
          "--pretrained", "none", "--beta-k", "64", "--workers", "0", "--batch-size", "32"])
    err = capsys.readouterr().err
    assert "warning: the shards hold 3 pairs on average" in err and "of --batch-size 32" in err
    assert "WARNING:pairclean" not in err and logging.getLogger("pairclean").propagate  # the CLI's, and only while it runs


def test_the_start_up_line_names_the_keys_a_parquet_without_a_key_column_gets(coco_src, tmp_path, capsys):
    """Before: `key=key` announced, while the rows became data/0, data/1, ..."""
    from helpers import run_cli

    records = [json.loads(line) for line in (coco_src / "pairs.jsonl").read_text().splitlines()][:4]
    pq.write_table(pa.table({"image": [(coco_src / r["image"]).read_bytes() for r in records],
                             "caption": [r["captions"][0] for r in records]}), tmp_path / "data.parquet")
    code, out, err = run_cli(["score", tmp_path / "data.parquet", "--out", tmp_path / "s.parquet", "--model",
                              "pairclean-tiny", "--pretrained", "none", "--beta-k", "16", "--workers", "0"], capsys)
    assert code == 0, err
    assert "key=file/row (data/0, data/1, ...: no 'key' column)" in out.splitlines()[0]
    assert pq.read_table(tmp_path / "s.parquet").column("key").to_pylist() == ["data/0", "data/1", "data/2", "data/3"]
