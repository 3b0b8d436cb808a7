"""Batches span units within pinned groups: full batches from many small shards, the same rows
bit for bit as the same pairs in a few large shards (both layouts one group), and a killed run resumed mid-group
reproduces the uninterrupted rows bit for bit."""

from __future__ import annotations

import io
import json
import os
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import webdataset as wds
from PIL import Image

from pairclean.scoring.model import GROUP_BATCHES, ScoreConfig, pack_units, score
from pairclean.runs import parts_dir_for


def _small_jpegs(coco_src: Path) -> list[bytes]:
    """The COCO test images at 48 px: decoding 2,400 of them takes about a second."""
    out = []
    for path in sorted(coco_src.rglob("*.jpg")):
        img = Image.open(path).convert("RGB").resize((48, 40))
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def _write_shards(directory: Path, jpegs: list[bytes], n_shards: int, per_shard: int) -> Path:
    """The same 2,400 pairs (same keys, bytes and captions, in the same order) in any shard layout."""
    directory.mkdir(parents=True)
    words = ["cat", "dog", "a red bus", "two people on a beach", "a plate of food", "snow"]
    for s in range(n_shards):
        with wds.TarWriter(str(directory / f"{s:06d}.tar")) as sink:
            for j in range(per_shard):
                i = s * per_shard + j
                sink.write({"__key__": f"pair{i:06d}", "jpg": jpegs[i % len(jpegs)],
                            "txt": " ".join(words[(i * k) % len(words)] for k in range(1, 2 + i % 5))})
    return directory


@pytest.fixture(scope="module")
def layouts(coco_src, tmp_path_factory):
    root = tmp_path_factory.mktemp("packing")
    jpegs = _small_jpegs(coco_src)
    return _write_shards(root / "small", jpegs, 60, 40), _write_shards(root / "large", jpegs, 3, 800)


CFG = ScoreConfig(model="pairclean-tiny", pretrained="none", precision="fp32", device="cpu", beta_k=64, workers=0,
                  batch_size=256, beta_mode="shuffled", seed=0)


def _by_key(path: Path) -> dict[str, dict]:
    return {r["key"]: r for r in pq.read_table(path).to_pylist()}


def test_units_are_packed_sixteen_batches_to_a_group():
    units = [f"u{i}" for i in range(100)]
    assert pack_units(units, 40, 256) == [units]  # 16 batches' worth is 103 units of 40
    assert pack_units(units, 5, 16) == [units[:52], units[52:]]  # 16 x 16 / 5 -> 52 units a group
    assert pack_units(units, 800, 256) == [units[i:i + 6] for i in range(0, 100, 6)]
    assert pack_units(units, 5000, 256) == [[u] for u in units]  # 16 batches or more: a unit per group
    assert GROUP_BATCHES == 16


def test_units_are_cut_into_a_group_for_every_reader_where_there_are_enough():
    """A DataLoader worker reads whole groups: 14 shards of 2,500 at batch 1,024 were 2 groups,
    so 2 of 14 workers decoded (an H100 run); with 14 readers they are 14 groups."""
    units = [f"u{i}" for i in range(14)]
    assert pack_units(units, 2500, 1024) == [units[:7], units[7:]]
    assert pack_units(units, 2500, 1024, readers=14) == [[u] for u in units]
    assert pack_units(units, 2500, 1024, readers=4) == [units[i:i + 4] for i in range(0, 14, 4)]
    assert pack_units(units, 2500, 1024, readers=50) == [[u] for u in units]  # fewer units than readers: one each
    assert pack_units(units, 40, 256, readers=2) == [units[:7], units[7:]]  # small units: still half each


def test_a_run_packs_its_units_for_its_workers(layouts):
    from dataclasses import replace

    from pairclean.scoring.model import ModelProducer
    from pairclean.data.dataset import open_dataset

    small, _ = layouts
    data = open_dataset(str(small))
    assert len(ModelProducer(data, replace(CFG, workers=0)).groups(data.units(), 1)) == 1
    assert len(ModelProducer(data, replace(CFG, workers=3)).groups(data.units(), 1)) == 3


def test_workers_left_to_pairclean_are_every_core_but_two_on_a_gpu_and_two_elsewhere(monkeypatch):
    """On a CUDA device the main thread and the prefetching thread keep a core each and a node's
    ranks share its cores (6 at most where the device decodes the JPEGs); a CPU run keeps 2 (the
    model needs the cores). What the run records and packs for is the number it resolved to."""
    import os

    import torch

    from pairclean.backends.device_jpeg import auto_workers
    from pairclean.scoring.model import ScoreConfig

    assert auto_workers("cpu") == 2 and ScoreConfig(device="cpu").resolved("image-text").workers == 2
    assert ScoreConfig(device="cpu", workers=0).resolved("image-text").workers == 0  # given: kept
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert auto_workers("auto") == auto_workers("cuda:1") == 14 and auto_workers("cpu") == 2
    assert ScoreConfig(device="cuda").resolved("image-text").workers == 14
    # A device decoder that runs here takes every JPEG: the workers only read and tokenise.
    import pairclean.backends.device_jpeg as device_jpeg

    monkeypatch.setattr(device_jpeg, "device_decoder_for", lambda decode, device: device_jpeg.DEVICE_DECODERS.get(decode))
    assert auto_workers("cuda", "gpu") == device_jpeg.DEVICE_DECODE_WORKERS == 6
    assert auto_workers("cuda", "gpu", cpu_decode_share=0.3) == 14  # the workers decode a share: every core
    assert auto_workers("cuda", "gpu-resize") == 14  # the workers decode every image, the device only resizes
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks on the node: 8 cores each
    assert auto_workers("cuda") == 6 and auto_workers("cuda", "gpu") == 6
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert auto_workers("cuda") == auto_workers("cuda", "gpu") == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert auto_workers("cuda") == 2  # never fewer than 2


def test_many_small_shards_fill_every_batch_and_match_few_large_shards(layouts, tmp_path):
    small, large = layouts
    a = score(str(small), tmp_path / "small.parquet", CFG)
    score(str(large), tmp_path / "large.parquet", CFG)
    # 2,400 pairs at batch 256: nine full batches and the run's last (96 rows), not 60 batches of 40.
    assert (a.summary.batches, a.summary.full_batches) == (10, 9)
    assert a.summary.mean_batch_fill == pytest.approx(2400 / 2560)
    rows_a, rows_b = _by_key(tmp_path / "small.parquet"), _by_key(tmp_path / "large.parquet")
    assert len(rows_a) == 2400 and rows_a.keys() == rows_b.keys()
    for key, row in rows_a.items():
        assert row["sim"] == rows_b[key]["sim"] and row["error"] is None  # bit for bit


def test_a_run_killed_inside_a_group_resumes_to_the_same_bits(layouts, tmp_path):
    from test_resume import forked

    small, _ = layouts
    cfg = replace(CFG, batch_size=128, beta_mode="random-inputs", beta_cache=False)  # 16 x 128 / 40: groups of 52, 8
    reference = tmp_path / "reference.parquet"
    score(str(small), reference, cfg)
    out = tmp_path / "resumed.parquet"
    # Killed right after the 5th commit: the first group is part committed, part not.
    assert forked(lambda: score(str(small), out, cfg), fault="committed:5") == -9
    parts = parts_dir_for(out)
    groups = json.loads((parts / "groups.json").read_text())
    assert [len(g) for g in groups] == [52, 8]
    assert len(list(parts.glob("part-*.done.json"))) == 5 and list((parts / "claims").iterdir())
    result = score(str(small), out, cfg)  # a new run clears the dead run's claim and redoes the group
    assert result.resumed and result.pairs_scored_now == 2400 - 5 * 40
    got, want = pq.read_table(out).to_pylist(), pq.read_table(reference).to_pylist()
    assert [(r["shard"], r["index"], r["key"]) for r in got] == [(r["shard"], r["index"], r["key"]) for r in want]
    assert [r["sim"] for r in got] == [r["sim"] for r in want]  # bit for bit, not approximately
    assert [r["weight"] for r in got] == [r["weight"] for r in want]
    assert not parts.exists() and not os.path.exists(str(out) + ".tmp")
