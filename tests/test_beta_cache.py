"""The random-inputs beta (`core/beta.py`) and its cache (`scoring/beta_cache.py`): the inputs depend
on the seed and K, never on the batch size; the cache is keyed by the weights (a checkpoint by its
hash), K, the seed and the draw, never the batch size; reused by later runs, ignored when unreadable."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from helpers import run_cli

from pairclean.core import beta as beta_module
from pairclean.scorefile.contract import read_provenance
from pairclean.scoring.beta_cache import BetaCache, cached_random_input_beta, weights_fingerprint
from pairclean.backends.open_clip import OpenClipEstimator
from pairclean.scoring.model import score


pytestmark = pytest.mark.usefixtures("fresh_notices")


def test_weights_fingerprint_sees_any_weight_change(tiny_estimator):
    import open_clip

    torch.manual_seed(0)
    net = open_clip.create_model("pairclean-tiny", pretrained=None)
    before = weights_fingerprint(net)
    assert weights_fingerprint(net) == before
    with torch.no_grad():
        net.visual.proj[0, 0] += 1e-3
    assert weights_fingerprint(net) != before


def test_beta_cache_reuses_beta_for_the_same_weights_only(coco_shards, fast_config, tmp_path, monkeypatch):
    """Also runs --compile (torch.compile replaced by identity to stay fast; real compilation is
    measured by the benchmarks): compile is not part of the cache key and changes scores only in
    their low bits."""
    monkeypatch.setenv("PAIRCLEAN_CACHE_DIR", str(tmp_path / "cache"))
    compiled_kwargs = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled_kwargs.append(kw) or fn)
    first = score(str(coco_shards), tmp_path / "1.parquet", fast_config)
    second = score(str(coco_shards), tmp_path / "2.parquet", replace(fast_config, compile=True))
    other_seed = score(str(coco_shards), tmp_path / "3.parquet", replace(fast_config, seed=1))
    assert compiled_kwargs == [{"dynamic": None, "mode": None}, {"dynamic": True, "mode": None}]  # image; text (trimmed); no CUDA graphs on CPU
    assert first.summary.beta_source == "computed" and second.summary.beta_source == "cache"
    assert second.summary.beta == first.summary.beta and second.summary.beta_std == first.summary.beta_std
    # a compiled tower runs partial batches padded to full ones: other matmul shapes, fp32 low bits
    compiled_sims = pq.read_table(tmp_path / "2.parquet").column("sim").to_numpy()
    assert np.abs(compiled_sims - pq.read_table(tmp_path / "1.parquet").column("sim").to_numpy()).max() < 1e-6
    assert other_seed.summary.beta_source == "computed" and other_seed.summary.beta != first.summary.beta
    assert len(list((tmp_path / "cache" / "beta").glob("*.json"))) == 2
    # An estimator handed in is named by a hash of its weights, never by its provenance alone.
    torch.manual_seed(0)
    changed = OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu")
    with torch.no_grad():
        changed.model.visual.proj.mul_(-1.0)
    handed_in = score(str(coco_shards), tmp_path / "4.parquet", fast_config, estimator=changed)
    assert handed_in.summary.beta_source == "computed" and handed_in.summary.beta != first.summary.beta


def test_beta_without_cache_is_computed_every_time(tiny_estimator, tmp_path):
    cache = BetaCache(tmp_path)
    computed, hit = cached_random_input_beta(tiny_estimator, "image", "text", k=16, seed=0, cache=cache)
    again, hit_again = cached_random_input_beta(tiny_estimator, "image", "text", k=16, seed=0, cache=cache)
    uncached, hit_none = cached_random_input_beta(tiny_estimator, "image", "text", k=16, seed=0, cache=None)
    assert (hit, hit_again, hit_none) == (False, True, False)
    assert computed == again == uncached


def test_beta_cache_ignores_an_unreadable_entry(tmp_path):
    cache = BetaCache(tmp_path)
    (tmp_path / "abc.json").write_text("{not json")
    assert cache.get("abc") is None and cache.get("missing") is None


def test_beta_cache_names_a_checkpoint_by_its_hash_not_its_path(tiny_estimator, tmp_path, monkeypatch):
    """The same checkpoint given by a relative and an absolute path hits the same cache entry."""
    ckpt = tmp_path / "tiny.pt"
    torch.save(tiny_estimator.model.state_dict(), ckpt)
    monkeypatch.chdir(tmp_path)
    cache = BetaCache(tmp_path / "cache")
    keys = [cache.key(OpenClipEstimator("pairclean-tiny", pretrained=path, device="cpu"), "image", "text", 16, 0)
            for path in ("tiny.pt", str(ckpt))]
    assert keys[0] == keys[1]


def test_beta_does_not_move_with_the_batch_size_and_a_second_run_reads_it_from_the_cache(coco_shards, tmp_path, capsys,
                                                                                          monkeypatch):
    """The same seed and K draw and encode the same inputs at any batch size: beta is equal to the
    bit, so its cache entry names no batch size and a run at another `--batch-size` reads it (issue
    56: a second run at another batch size paid beta's 262 s again, the batch size being in the key;
    before issue 46 the inputs themselves moved: -0.0650 at batch 256, -0.0666 at 32, K 1024)."""
    monkeypatch.setenv("PAIRCLEAN_CACHE_DIR", str(tmp_path / "cache"))
    found = {}
    for batch in ("256", "24", "8"):
        out = tmp_path / f"b{batch}.parquet"
        code, stdout, err = run_cli(["score", coco_shards, "--out", out, "--model", "pairclean-tiny", "--pretrained",
                                     "none", "--workers", "0", "--beta-k", "96", "--batch-size", batch], capsys)
        assert code == 0, err
        found[batch] = (read_provenance(out).beta, read_provenance(out).beta_source)
    assert found["256"] == (found["24"][0], "computed") and found["24"][1] == found["8"][1] == "cache"
    code, _, err = run_cli(["score", coco_shards, "--out", tmp_path / "nc.parquet", "--model", "pairclean-tiny",
                            "--pretrained", "none", "--workers", "0", "--beta-k", "96", "--batch-size", "8",
                            "--no-beta-cache"], capsys)
    assert code == 0 and read_provenance(tmp_path / "nc.parquet").beta == found["256"][0], err  # to the bit
    assert len(list((tmp_path / "cache" / "beta").glob("*.json"))) == 1


def test_a_beta_drawn_another_way_is_never_served(tiny_estimator, tmp_path, monkeypatch):
    cache = BetaCache(tmp_path)
    key = cache.key(tiny_estimator, "image", "text", 16, 0)
    assert cache.key(tiny_estimator, "image", "text", 16, 0) == key
    assert cache.key(tiny_estimator, "image", "text", 32, 0) != key and cache.key(tiny_estimator, "image", "text", 16, 1) != key
    monkeypatch.setattr("pairclean.scoring.beta_cache.RANDOM_INPUTS_VERSION", beta_module.RANDOM_INPUTS_VERSION - 1)
    assert cache.key(tiny_estimator, "image", "text", 16, 0) != key
