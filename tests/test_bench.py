"""Throughput machinery with the tiny model: exact text trimming, OOM back-off, device JPEG
decode (exercised on the CPU), compile fallback, precision resolution, beta cache, `bench score`."""

from __future__ import annotations

import io
import json
import logging

from dataclasses import replace

import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

import pairclean.ops.notices as notices
from pairclean.backends.base import cpu_bf16_native, resolve_precision
from pairclean.backends.compiled import CompiledOrEager
from pairclean.backends.device_jpeg import DeviceJpegDecoder, RawJpeg, finish_batch
from pairclean.backends.oom import OomBackoff, take_rows
from pairclean.backends.text_trim import supports_text_trim, text_buckets
from pairclean.ops.measure import PeakMemory, high_water_rss_mib
from pairclean.scoring.bench import bench_score
from pairclean.scoring.beta_cache import BetaCache, cached_random_input_beta, weights_fingerprint
from pairclean.cli import main
from pairclean.lab.coco import read_pairs
from pairclean.errors import UserError
from pairclean.backends.open_clip import OpenClipEstimator, OpenClipPreparer
from pairclean.scoring.model import score


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu")


@pytest.fixture(autouse=True)
def _fresh_notices():
    notices._said.clear()  # every test sees its own once-only notices
    yield


def _jpeg_bytes(coco_src, n):
    return [(coco_src / p["image"]).read_bytes() for p in read_pairs(coco_src)[:n]]


def test_trimmed_text_tower_matches_the_full_context(tiny):
    captions = ["a dog", "two people riding horses along a beach at sunset while a dog runs beside them", "x"]
    tokens = tiny.tokenizer(captions)
    assert tiny.text_trim and tokens.shape[1] == 32
    full = torch.nn.functional.normalize(tiny.model.encode_text(tokens).float(), dim=-1)
    torch.testing.assert_close(tiny.encode("text", tokens), full, atol=1e-5, rtol=0)
    # Each caption alone (a shorter trim) gives its own row of the batch result.
    for i in range(len(captions)):
        torch.testing.assert_close(tiny.encode("text", tokens[i:i + 1]), full[i:i + 1], atol=1e-5, rtol=0)


def test_length_buckets_keep_rows_in_order_and_exact(tiny):
    words = "a large red star above a small blue circle on a green background near the top left corner".split()
    captions = [" ".join(words[: 1 + (i * 7) % len(words)]) for i in range(300)]
    tokens = tiny.tokenizer(captions)
    assert [len(rows) for rows in text_buckets(tokens)] == [150, 150]
    full = torch.nn.functional.normalize(tiny.model.encode_text(tokens).float(), dim=-1)
    torch.testing.assert_close(tiny.encode("text", tokens), full, atol=1e-5, rtol=0)


def test_a_copy_with_another_model_encodes_with_that_model(tiny):
    """Training's frozen online estimator is a copy of the estimator with `.model` replaced."""
    import copy

    frozen = copy.copy(tiny)
    frozen.model = copy.deepcopy(tiny.model)
    with torch.no_grad():
        frozen.model.text_projection.mul_(-1.0)
        frozen.model.visual.proj.mul_(-1.0)
    tokens = tiny.tokenizer(["a red circle", "two blue squares"])
    pixels = tiny.random_batch("image", 2, torch.Generator().manual_seed(0))
    torch.testing.assert_close(frozen.encode("text", tokens), -tiny.encode("text", tokens))
    torch.testing.assert_close(frozen.encode("image", pixels), -tiny.encode("image", pixels))


def test_text_trim_is_refused_where_it_would_not_be_exact(tiny):
    import open_clip

    net = open_clip.create_model("pairclean-tiny", pretrained=None)
    assert supports_text_trim(net)
    net.text_pool_type = "last"  # the last position sees the padding: trimming would change it
    assert not supports_text_trim(net)
    net.text_pool_type = "argmax"
    net.attn_mask = None  # bidirectional attention: the EOT position sees the padding
    assert not supports_text_trim(net)


def test_oom_backoff_halves_once_keeps_the_size_and_reports_once(caplog):
    calls = []

    def encode(batch):
        calls.append(batch.shape[0])
        if batch.shape[0] > 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch * 2

    backoff = OomBackoff()
    with caplog.at_level(logging.WARNING, logger="pairclean"):
        first = backoff(encode, torch.arange(10.0).view(10, 1))
        second = backoff(encode, torch.arange(5.0).view(5, 1))
    torch.testing.assert_close(first, torch.arange(10.0).view(10, 1) * 2)
    torch.testing.assert_close(second, torch.arange(5.0).view(5, 1) * 2)
    assert backoff.chunk == 2 and backoff.halvings == 2  # 10 -> 5 -> 2, then kept for the next batch
    assert calls == [10, 5, 2, 2, 2, 2, 2, 2, 2, 1]
    assert sum("out of memory" in r.getMessage() for r in caplog.records) == 1


def test_oom_backoff_leaves_other_errors_alone():
    def broken(batch):
        raise ValueError("not a memory problem")

    with pytest.raises(ValueError):
        OomBackoff()(broken, torch.zeros(4, 1))


def test_take_rows_keeps_the_batch_kind():
    batch = {"input_ids": torch.arange(8).view(4, 2), "mask": torch.ones(4, 2)}
    picked = take_rows(batch, [0, 3])
    assert picked["input_ids"].tolist() == [[0, 1], [6, 7]] and picked["mask"].shape == (2, 2)
    assert take_rows(["a", "b", "c"], [2, 0]) == ["c", "a"]
    assert take_rows(torch.arange(5), slice(1, 3)).tolist() == [1, 2]


def test_device_jpeg_decode_matches_pil_preprocessing(tiny, coco_src):
    datas = _jpeg_bytes(coco_src, 4)
    decoder = DeviceJpegDecoder(tiny.preparer.preprocess, torch.device("cpu"))
    pixels, failed = decoder({"jpeg": [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas],
                              "jpeg_rows": [0, 1, 2, 3], "pixels": None, "pixel_rows": [], "n": 4})
    reference = torch.stack([tiny.preparer.preprocess(Image.open(io.BytesIO(d)).convert("RGB")) for d in datas])
    assert failed == {} and pixels.shape == reference.shape
    # Tensor resize vs PIL resize: about a grey level apart, same embeddings to 3 decimals.
    assert (pixels - reference).abs().mean() < 0.03
    cos = (tiny.encode("image", pixels) * tiny.encode("image", reference)).sum(-1)
    assert cos.min() > 0.999


def test_finish_batch_turns_undecodable_jpegs_into_error_rows_and_keeps_sides_aligned(tiny, coco_src):
    good = _jpeg_bytes(coco_src, 3)
    broken = good[1][:600]  # a valid header, then nothing: the header check passes, decoding fails
    png = io.BytesIO()
    Image.open(io.BytesIO(good[2])).save(png, format="PNG")
    images = [good[0], broken, png.getvalue(), good[2]]
    preparer = OpenClipPreparer(tiny.preparer.preprocess, tiny.tokenizer, draft_size=None, device_jpeg=True)
    prepared = [preparer.prepare("image", x) for x in images]
    assert [isinstance(p, RawJpeg) for p in prepared] == [True, True, False, True]  # PNG decoded in the worker
    captions = ["zero", "one", "two", "three"]
    batch = {"error": [None, None, "bad caption", None, None],
             "left": preparer.collate("image", prepared), "right": preparer.collate("text", captions)}

    class OnCpu:  # what OpenClipEstimator holds with --decode gpu on CUDA, here on the CPU
        device_decoder = DeviceJpegDecoder(tiny.preparer.preprocess, torch.device("cpu"))

    out = finish_batch(OnCpu(), batch, "image", "text")
    assert out["error"][0] is None and out["error"][2] == "bad caption"
    assert out["error"][1].startswith("cannot decode image")
    assert out["left"].shape[0] == out["right"].shape[0] == 3
    assert out["right"].tolist() == tiny.tokenizer(["zero", "two", "three"]).tolist()
    expected_png_row = preparer.preprocess(Image.open(io.BytesIO(png.getvalue())).convert("RGB"))
    torch.testing.assert_close(out["left"][1], expected_png_row)


def test_decode_gpu_falls_back_to_worker_decode_without_cuda(caplog):
    with caplog.at_level(logging.WARNING, logger="pairclean"):
        est = OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu", decode="gpu")
    assert est.decode == "fast" and est.device_decoder is None and not est.preparer.device_jpeg
    assert any("`decode` gpu needs a CUDA device" in r.getMessage() for r in caplog.records)
    with pytest.raises(UserError, match="unknown decode"):
        OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu", decode="turbo")


def test_precision_auto_and_bf16_detection():
    cpu = torch.device("cpu")
    assert resolve_precision(cpu, "auto") == ("bf16" if cpu_bf16_native() else "fp32")
    assert resolve_precision(cpu, "fp32") == "fp32"
    with pytest.raises(UserError, match="needs a CUDA device"):
        resolve_precision(cpu, "fp16")
    with pytest.raises(UserError, match="unknown precision"):
        resolve_precision(cpu, "fp8")


def test_bf16_autocast_on_cpu_stays_close_to_fp32(tiny, coco_src):
    torch.manual_seed(0)
    bf16 = OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu", precision="bf16")
    pixels = torch.stack([tiny.preparer.prepare("image", d) for d in _jpeg_bytes(coco_src, 4)])
    cos = (tiny.encode("image", pixels) * bf16.encode("image", pixels)).sum(-1)
    assert cos.min() > 0.99


def test_compile_failure_falls_back_to_eager_once(monkeypatch, caplog):
    def failing_compile(fn, **kwargs):
        def compiled(*args):
            raise RuntimeError("inductor: no working C++ compiler")
        return compiled

    monkeypatch.setattr(torch, "compile", failing_compile)
    calls = []
    wrapped = CompiledOrEager(lambda x: calls.append(x) or x + 1, "image")
    with caplog.at_level(logging.WARNING, logger="pairclean"):
        assert wrapped(1) == 2 and wrapped(2) == 3
    assert calls == [1, 2]
    assert sum("running it eagerly" in r.getMessage() for r in caplog.records) == 1


def test_weights_fingerprint_sees_any_weight_change(tiny):
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
    measured by the benchmarks): compile is not part of the cache key and changes no score."""
    monkeypatch.setenv("PAIRCLEAN_CACHE_DIR", str(tmp_path / "cache"))
    compiled_kwargs = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled_kwargs.append(kw) or fn)
    first = score(str(coco_shards), tmp_path / "1.parquet", fast_config)
    second = score(str(coco_shards), tmp_path / "2.parquet", replace(fast_config, compile=True))
    other_seed = score(str(coco_shards), tmp_path / "3.parquet", replace(fast_config, seed=1))
    assert compiled_kwargs == [{"dynamic": None}, {"dynamic": True}]  # image tower; text with trimmed lengths
    assert first.summary["beta_source"] == "computed" and second.summary["beta_source"] == "cache"
    assert second.summary["beta"] == first.summary["beta"] and second.summary["beta_std"] == first.summary["beta_std"]
    assert [r["sim"] for r in pq.read_table(tmp_path / "2.parquet").to_pylist()] == \
        [r["sim"] for r in pq.read_table(tmp_path / "1.parquet").to_pylist()]
    assert other_seed.summary["beta_source"] == "computed" and other_seed.summary["beta"] != first.summary["beta"]
    assert len(list((tmp_path / "cache" / "beta").glob("*.json"))) == 2
    # An estimator handed in is named by a hash of its weights, never by its provenance alone.
    torch.manual_seed(0)
    changed = OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu")
    with torch.no_grad():
        changed.model.visual.proj.mul_(-1.0)
    handed_in = score(str(coco_shards), tmp_path / "4.parquet", fast_config, estimator=changed)
    assert handed_in.summary["beta_source"] == "computed" and handed_in.summary["beta"] != first.summary["beta"]


def test_beta_without_cache_is_computed_every_time(tiny, tmp_path):
    cache = BetaCache(tmp_path)
    computed, hit = cached_random_input_beta(tiny, "image", "text", k=16, seed=0, batch_size=8, cache=cache)
    again, hit_again = cached_random_input_beta(tiny, "image", "text", k=16, seed=0, batch_size=8, cache=cache)
    uncached, hit_none = cached_random_input_beta(tiny, "image", "text", k=16, seed=0, batch_size=8, cache=None)
    assert (hit, hit_again, hit_none) == (False, True, False)
    assert computed == again == uncached


def test_beta_cache_ignores_an_unreadable_entry(tmp_path):
    cache = BetaCache(tmp_path)
    (tmp_path / "abc.json").write_text("{not json")
    assert cache.get("abc") is None and cache.get("missing") is None


def test_peak_memory_sees_an_allocation():
    with PeakMemory(interval=0.01) as base:
        pass
    with PeakMemory(interval=0.01) as mem:
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched, alive at the end-of-block sample
        block += 1
    assert mem.peak_rss_mib > base.peak_rss_mib + 48 and mem.peak_mib > base.peak_mib + 48


def test_a_childs_peak_rss_is_its_own_not_the_parents_at_spawn():
    # Linux carries ru_maxrss across fork + exec: a child spawned by a parent holding 256 MiB
    # reports >= 256 MiB there. VmHWM, which the benchmarks read, starts afresh at exec.
    import subprocess
    import sys

    held = torch.ones(256 * 2**20 // 4)
    held += 1
    child = subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        child.stdout.readline()  # the child is running its own program
        with PeakMemory(child.pid, interval=0.01) as mem:
            pass
        assert 0 < high_water_rss_mib(child.pid) < 128 and 0 < mem.high_water_mib < 128
    finally:
        child.kill()
        child.wait()
    assert high_water_rss_mib() > 256  # this process's own peak
    del held


def test_bench_score_cli_measures_all_three_and_prints_ratios(coco_shards, tmp_path, capsys):
    out = tmp_path / "bench.json"
    main(["bench", "score", str(coco_shards), "--model", "pairclean-tiny", "--pretrained", "none",
          "--batch-size", "8", "--workers", "1", "--beta-k", "64", "--naive-pairs", "12", "--min-seconds", "0",
          "--json", str(out)])
    printed = capsys.readouterr().out
    assert "end-to-end / ceiling =" in printed and "end-to-end / naive =" in printed
    assert "2 batches, 2 full, mean fill 100.0% of --batch-size 8" in printed
    assert ("GPU: no CUDA device" in printed) != torch.cuda.is_available()
    (r,) = json.loads(out.read_text())["rounds"]
    assert r["ceiling"]["pairs"] >= 16 and r["end_to_end"]["pairs"] == 16 and r["naive"]["pairs"] == 12
    # 6 + 6 + 4 rows packed into one group (batches span shards, docs/benchmarks.md): two full batches of 8
    assert r["ceiling"]["extra"]["batches_per_pass"] == 2
    assert (r["end_to_end"]["extra"]["batches"], r["end_to_end"]["extra"]["full_batches"]) == (2, 2)
    assert r["end_to_end_over_ceiling"] > 0 and r["end_to_end_over_naive"] > 0 and r["end_to_end"]["peak_mib"] > 0
    assert r["ceiling"]["extra"]["text_tokens_trimmed"] < r["ceiling"]["extra"]["text_tokens_full"] == 32
    assert r["end_to_end"]["extra"]["beta_source"] in ("computed", "cache")


def test_bench_refuses_bad_settings(coco_shards, fast_config):
    with pytest.raises(UserError, match="repeat must be at least 1"):
        bench_score(str(coco_shards), fast_config, repeat=0)


@pytest.mark.slow
def test_real_torch_compile_encodes_like_eager(tiny, coco_src):
    """Inductor on this machine's C++ compiler (minutes on 2 cores, so slow-marked); if it cannot
    compile, the estimator still encodes (eagerly) and says so once."""
    torch.manual_seed(0)
    compiled = OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu", compile=True)
    pixels = torch.stack([tiny.preparer.prepare("image", d) for d in _jpeg_bytes(coco_src, 4)])
    tokens = tiny.tokenizer(["a red circle", "two people riding horses along a beach", "x", "a dog"])
    torch.testing.assert_close(compiled.encode("image", pixels), tiny.encode("image", pixels), atol=1e-4, rtol=0)
    torch.testing.assert_close(compiled.encode("text", tokens), tiny.encode("text", tokens), atol=1e-4, rtol=0)
    torch.testing.assert_close(compiled.encode("text", tokens[:2]), tiny.encode("text", tokens[:2]), atol=1e-4, rtol=0)


def test_beta_cache_names_a_checkpoint_by_its_hash_not_its_path(tiny, tmp_path, monkeypatch):
    """The same checkpoint given by a relative and an absolute path hits the same cache entry."""
    ckpt = tmp_path / "tiny.pt"
    torch.save(tiny.model.state_dict(), ckpt)
    monkeypatch.chdir(tmp_path)
    cache = BetaCache(tmp_path / "cache")
    keys = [cache.key(OpenClipEstimator("pairclean-tiny", pretrained=path, device="cpu"), "image", "text", 16, 0, 8)
            for path in ("tiny.pt", str(ckpt))]
    assert keys[0] == keys[1]
