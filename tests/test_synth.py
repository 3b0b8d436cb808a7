"""The toy world: deterministic under its seed, captions that describe what is drawn, and the
tiny estimator's checkpoint loading through the normal open_clip path."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pairclean.cli import main
from pairclean.errors import UserError
from pairclean.data.manifest import load_manifest
from pairclean.data.reading.tar import read_samples
from pairclean.lab.synth.estimator import TOY_MODEL, EstimatorRecipe, cached_checkpoint, train_estimator
from pairclean.lab.synth.world import (COLOURS, GRID, IMAGE_SIZE, PREFIXES, ToyObject, build_world, describe, relation,
                                   render, sample_scene, samples)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def samples_of(directory: Path) -> list[dict]:
    out = []
    for shard in sorted(directory.glob("*.tar")):
        failures: list = []
        out.extend({"__key__": s.key, **s.members} for s in read_samples(str(shard), failures.append))
        assert not failures
    return out


def test_world_is_deterministic_under_its_seed(tmp_path):
    build_world(tmp_path / "a", 12, seed=3, shard_size=5)
    build_world(tmp_path / "b", 12, seed=3, shard_size=100)  # sharding does not change the pairs
    build_world(tmp_path / "c", 12, seed=4)
    a, b, c = samples_of(tmp_path / "a"), samples_of(tmp_path / "b"), samples_of(tmp_path / "c")
    assert len(a) == 12 and len(list((tmp_path / "a").glob("*.tar"))) == 3
    assert a == b  # every member byte for byte
    assert [s["txt"] for s in a] != [s["txt"] for s in c]
    assert [s["png"] for s in a] != [s["png"] for s in c]
    spec = load_manifest(tmp_path / "a" / "manifest.yaml")
    assert spec.fields.image == "png" and len(spec.shards) == 3


def test_world_is_varied():
    scenes = [sample_scene(0, i) for i in range(300)]
    objects = [o for s in scenes for o in s.objects]
    assert {len(s.objects) for s in scenes} == {1, 2, 3}
    assert {o.colour for o in objects} == set(COLOURS)
    assert {o.shape for o in objects} >= {"circle", "square", "triangle", "star"}
    assert {o.size for o in objects} == {"small", "large"}
    assert {(o.row, o.col) for o in objects} == {(r, c) for r in range(GRID) for c in range(GRID)}
    assert len({s.background for s in scenes}) == 300
    assert len({s.caption() for s in scenes}) > 290  # captions almost never repeat


def test_captions_state_the_layout():
    red = ToyObject("red", "circle", "small", row=0, col=0)
    blue = ToyObject("blue", "square", "large", row=2, col=0)
    green = ToyObject("green", "star", "small", row=2, col=2)
    assert relation(red, blue) == "above"
    assert relation(blue, green) == "to the left of"
    assert relation(green, red) == "below and to the right of"
    assert describe([red]) == "a small red circle in the top left"
    assert describe([red, blue, green]) == ("a small red circle above a large blue square, "
                                            "and a small green star in the bottom right")


def test_image_shows_the_captioned_colour_where_the_caption_says():
    for i in range(40):
        scene = sample_scene(1, i)
        if len(scene.objects) != 1 or scene.objects[0].shape in ("cross", "star"):
            continue  # a cross or a star may leave its centre's neighbourhood uncovered
        obj = scene.objects[0]
        pixels = np.asarray(render(scene), dtype=np.int16)
        assert pixels.shape == (IMAGE_SIZE, IMAGE_SIZE, 3)
        cell = IMAGE_SIZE / GRID
        y, x = int((obj.row + 0.5) * cell + scene.jitter[0][1]), int((obj.col + 0.5) * cell + scene.jitter[0][0])
        assert np.abs(pixels[y, x] - np.asarray(COLOURS[obj.colour])).max() <= 20, scene.caption()
        assert obj.colour in scene.caption() and obj.shape in scene.caption()


def test_sample_members():
    [s] = samples(2, 7)
    assert s["__key__"] == "toy-2-0000007"
    assert Image.open(io.BytesIO(s["png"])).size == (IMAGE_SIZE, IMAGE_SIZE)
    scene = json.loads(s["json"])
    assert "caption" not in scene  # a corrupted copy must not keep the true caption elsewhere
    assert all(o["colour"] in s["txt"] for o in scene["objects"])


def test_several_captions_per_scene_say_the_same_facts():
    """COCO-style scenes: K captions of one image, the first the single-caption world's own, the
    others other orders and openings of the same objects and layout, distinct while they last."""
    for index in range(40):
        scene = sample_scene(0, index)
        captions = scene.captions(5, 0, index)
        assert captions[0] == scene.caption()
        variants = len(PREFIXES) * {1: 1, 2: 2, 3: 6}[len(scene.objects)]
        assert len(set(captions)) == min(5, variants)
        for text in captions:
            for obj in scene.objects:
                assert obj.phrase() in text
        if len(scene.objects) == 2:  # the relation is turned round with the order
            a, b = scene.objects
            both = {f"{a.phrase()} {relation(a, b)} {b.phrase()}", f"{b.phrase()} {relation(b, a)} {a.phrase()}"}
            assert all(any(t == p + d for p in PREFIXES for d in both) for t in captions), captions
    group = samples(0, 3, captions_per_scene=5)
    assert [s["__key__"] for s in group] == [f"toy-0-0000003-{j}" for j in range(5)]
    assert len({s["png"] for s in group}) == 1 and len({s["txt"] for s in group}) == 5


def test_world_with_several_captions(tmp_path):
    spec = build_world(tmp_path / "w", 15, seed=2, shard_size=4, captions_per_scene=5)
    got = samples_of(tmp_path / "w")
    assert len(got) == 15 and spec.name == "toy-world-seed2-5-captions"
    assert [g["__key__"] for g in got[:6]] == [f"toy-2-{i:07d}-{j}" for i in (0, 1) for j in range(5)][:6]
    with pytest.raises(UserError, match="multiple of captions_per_scene"):
        build_world(tmp_path / "x", 12, captions_per_scene=5)


def test_world_refuses_bad_sizes(tmp_path):
    with pytest.raises(UserError, match="pairs must be at least 1"):
        build_world(tmp_path / "w", 0)
    with pytest.raises(UserError, match="shard_size must be at least 1"):
        build_world(tmp_path / "w", 5, shard_size=0)


def test_cli_toy_world(tmp_path, capsys):
    main(["synth", "toy-world", "--out", str(tmp_path / "w"), "--pairs", "6", "--seed", "1"])
    assert "6 pairs" in capsys.readouterr().out
    assert [s["txt"].decode() for s in samples_of(tmp_path / "w")] == [sample_scene(1, i).caption() for i in range(6)]


def test_estimator_trains_with_the_trainer_and_loads_through_open_clip(tmp_path):
    import open_clip
    import torch

    from pairclean.backends.open_clip import register_model_configs

    recipe = EstimatorRecipe(pairs=32, batch_size=16, epochs=1, warmup_steps=1)
    cache = tmp_path / "cache"
    assert cached_checkpoint(recipe, cache) is None
    checkpoint = train_estimator(tmp_path / "est", recipe, workers=0, cache_dir=cache)
    assert checkpoint == tmp_path / "est" / "estimator.pt"
    assert cached_checkpoint(recipe, cache).read_bytes() == checkpoint.read_bytes()
    assert (tmp_path / "est" / "run" / "run.json").is_file()  # pairclean.training's own run directory
    record = json.loads((tmp_path / "est" / "estimator.json").read_text())
    assert record["recipe"]["pairs"] == 32 and len(record["epochs"]) == 1
    register_model_configs()
    model, _, _ = open_clip.create_model_and_transforms(TOY_MODEL, pretrained=str(checkpoint), weights_only=True)
    saved = torch.load(checkpoint, weights_only=True)
    assert torch.equal(model.state_dict()["logit_scale"], saved["logit_scale"])
    fresh, _, _ = open_clip.create_model_and_transforms(TOY_MODEL)
    assert not torch.equal(fresh.state_dict()["text_projection"], saved["text_projection"])
    assert EstimatorRecipe(pairs=64).cache_key() != recipe.cache_key()


def test_web_shards_are_img2dataset_sized_and_deterministic(tmp_path):
    import webdataset as wds

    from pairclean.lab.coco import WEB_SIDE, build_web_shards

    src = Path(__file__).parent / "data" / "coco-mini"
    main(["synth", "web-shards", "--src", str(src), "--out", str(tmp_path / "a"), "--shards", "2",
          "--pairs-per-shard", "20"])
    spec = build_web_shards(src, tmp_path / "b", shards=2, pairs_per_shard=20, jobs=2)  # rendered by 2 processes
    assert [Path(s).name for s in spec.shards] == ["web-000000.tar", "web-000001.tar"]
    samples = list(wds.WebDataset(spec.shards, shardshuffle=False))
    again = list(wds.WebDataset(load_manifest(tmp_path / "a" / "manifest.yaml").shards, shardshuffle=False))
    members = ("__key__", "jpg", "txt")  # a function of (seed, i): the same members, byte for byte
    assert [[s[m] for m in members] for s in again] == [[s[m] for m in members] for s in samples]
    assert len(samples) == 40 and len({s["__key__"] for s in samples}) == 40
    sizes = [Image.open(io.BytesIO(s["jpg"])).size for s in samples]
    assert all(WEB_SIDE[0] <= max(size) <= WEB_SIDE[1] for size in sizes)
    assert len(set(sizes)) > 10 and all(s["txt"].strip() for s in samples)  # varied, with real captions


def test_web_shards_write_a_share_of_progressive_jpegs_of_the_same_pictures(tmp_path):
    """`--progressive`: that share of the JPEGs written progressive, drawn from (seed, i); the
    pixels, captions and every other pair's bytes are those of the baseline shards."""
    import webdataset as wds

    from pairclean.lab.coco import build_web_shards

    src = Path(__file__).parent / "data" / "coco-mini"
    base = build_web_shards(src, tmp_path / "base", shards=1, pairs_per_shard=40)
    main(["synth", "web-shards", "--src", str(src), "--out", str(tmp_path / "p"), "--shards", "1",
          "--pairs-per-shard", "40", "--progressive", "0.5"])
    plain = list(wds.WebDataset(base.shards, shardshuffle=False))
    mixed = list(wds.WebDataset(load_manifest(tmp_path / "p" / "manifest.yaml").shards, shardshuffle=False))
    flags = [bool(Image.open(io.BytesIO(s["jpg"])).info.get("progressive")) for s in mixed]
    assert 10 <= sum(flags) <= 30 and not any(Image.open(io.BytesIO(s["jpg"])).info.get("progressive") for s in plain)
    for a, b, flag in zip(plain, mixed, flags):
        assert a["__key__"] == b["__key__"] and a["txt"] == b["txt"]
        assert (a["jpg"] != b["jpg"]) == flag
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(a["jpg"]))), np.asarray(Image.open(io.BytesIO(b["jpg"]))))
    with pytest.raises(UserError, match="progressive"):
        build_web_shards(src, tmp_path / "bad", shards=1, pairs_per_shard=4, progressive=1.5)


def test_web_shards_hold_a_share_of_a_crawls_other_files_drawn_from_the_seed(tmp_path):
    """`--bad-share`: that share of the images stored as the files a web crawl also holds (truncated
    JPEGs, PNG, WebP, CMYK, progressive and greyscale JPEGs, empty files, headers declaring
    65,000 x 65,000 pixels), each pair's kind drawn from (seed, i); every other pair's bytes are the
    clean shards'. Each kind reads as its format says, and the broken ones fail `decode_image` with
    the reason a row's error gives."""
    import webdataset as wds

    from pairclean.data.decode import DecodeError, decode_image
    from pairclean.lab.coco import BAD_KINDS, HUGE_SIDE, build_web_shards

    src = Path(__file__).parent / "data" / "coco-mini"
    clean = build_web_shards(src, tmp_path / "clean", shards=1, pairs_per_shard=48, seed=3)
    main(["synth", "web-shards", "--src", str(src), "--out", str(tmp_path / "bad"), "--shards", "1",
          "--pairs-per-shard", "48", "--seed", "3", "--bad-share", "0.5"])
    again = build_web_shards(src, tmp_path / "again", shards=1, pairs_per_shard=48, seed=3, bad_share=0.5, jobs=2)
    plain = list(wds.WebDataset(clean.shards, shardshuffle=False))
    bad = list(wds.WebDataset(load_manifest(tmp_path / "bad" / "manifest.yaml").shards, shardshuffle=False))
    assert [s["jpg"] for s in wds.WebDataset(again.shards, shardshuffle=False)] == [s["jpg"] for s in bad]
    kinds = {}
    for a, b in zip(plain, bad):
        assert a["__key__"] == b["__key__"] and a["txt"] == b["txt"]
        if a["jpg"] == b["jpg"]:
            continue
        data = b["jpg"]
        if not data:
            kind = "empty"
        elif a["jpg"].startswith(data):
            kind = "truncated"
        elif data[:4] == b"\x89PNG" or data[:4] == b"RIFF":
            kind = Image.open(io.BytesIO(data)).format.lower()
        elif HUGE_SIDE.to_bytes(2, "big") * 2 in data[:1000]:  # the frame header's height and width
            kind = "huge"
        else:
            with Image.open(io.BytesIO(data)) as img:
                kind = ("cmyk" if img.mode == "CMYK" else "grayscale" if img.mode == "L"
                        else "progressive" if img.info.get("progressive") else "?")
        kinds[kind] = kinds.get(kind, 0) + 1
        if kind in ("truncated", "empty", "huge"):
            with pytest.raises(DecodeError):
                decode_image(data)
        else:
            assert decode_image(data).mode == "RGB"
    assert set(kinds) == set(BAD_KINDS) and 12 <= sum(kinds.values()) <= 36
    with pytest.raises(UserError, match="bad_share|bad-share"):
        build_web_shards(src, tmp_path / "x", shards=1, pairs_per_shard=4, bad_share=2.0)
