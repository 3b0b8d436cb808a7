"""Every pair kind from WebDataset and Parquet: text-text, image-label (label template), image-image."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pairclean.cli import main
from pairclean.lab.coco import read_pairs
from pairclean.errors import UserError
from pairclean.scorefile.contract import read_provenance
from pairclean.data.dataset import Dataset, as_dataset, open_dataset
from pairclean.data.writer import write_shards
from pairclean.scoring.model import score
from pairclean.data.spec import DatasetSpec, RawPair
from pairclean.lab.synth.world import png_bytes, render, sample_scene
from pairclean.lab.toy_pairs import build_toy_pairs, second_view

LABELS = ["giraffe", "bus", "pizza", "dog", "cat", "train", "zebra", "kite"]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, coco_src) -> dict:
    """8 COCO images with every field a pair kind needs, as 2 tar shards and one Parquet file.

    Pair i: second image = image i for even i (identical pair) or image i+1 for odd i; label
    LABELS[i] except pair 5, which has none; second caption = caption 2 of the image except pair 6.
    """
    src = read_pairs(coco_src, all_captions=True)
    firsts = [p for p in src if p["key"].endswith("_0")][:9]
    seconds = {p["key"][:-2]: p["caption"] for p in src if p["key"].endswith("_1")}
    images = [(coco_src / p["image"]).read_bytes() for p in firsts]
    rows = []
    for i in range(8):
        key = firsts[i]["key"][:-2]
        rows.append({"key": key, "image": images[i], "image2": images[i if i % 2 == 0 else i + 1],
                     "label": None if i == 5 else LABELS[i], "caption": firsts[i]["caption"],
                     "caption2": None if i == 6 else seconds[key]})
    root = tmp_path_factory.mktemp("kinds")
    (root / "wds").mkdir()
    samples = []
    for r in rows:
        sample = {"__key__": r["key"], "jpg": r["image"], "jpg2": r["image2"], "txt": r["caption"]}
        if r["label"] is not None:
            sample["cls"] = r["label"]
        if r["caption2"] is not None:
            sample["txt2"] = r["caption2"]
        samples.append(sample)
    write_shards(samples, root / "wds", prefix="kinds", maxcount=4)
    pq.write_table(pa.Table.from_pylist(rows), root / "kinds.parquet", row_group_size=3)
    return {"rows": rows, "wds": str(root / "wds"), "parquet": str(root / "kinds.parquet")}


def _read_all(source: Dataset | DatasetSpec) -> list[RawPair]:
    dataset = as_dataset(source)
    return [item for unit in dataset.units() for item in dataset.read(unit) if isinstance(item, RawPair)]


@pytest.mark.parametrize("fmt", ["wds", "parquet"])
def test_each_pair_kind_reads_its_two_sides(mixed, fmt):
    rows = mixed["rows"]
    text = _read_all(open_dataset(mixed[fmt], pair="text-text"))
    assert [(p.left, p.right) for p in text if p.error is None] == \
        [(r["caption"], r["caption2"]) for r in rows if r["caption2"] is not None]
    assert text[6].right is None and text[6].error == "missing second text"

    labels = _read_all(open_dataset(mixed[fmt], pair="image-label"))
    assert [p.right for p in labels] == [None if r["label"] is None else f"This is a picture of {r['label']}."
                                         for r in rows]
    assert labels[5].error is not None and "label" in labels[5].error and labels[0].left == rows[0]["image"]
    custom = _read_all(open_dataset(mixed[fmt], pair="image-label", label_template="a photo of a {label}, a kind of object"))
    assert custom[1].right == "a photo of a bus, a kind of object"

    images = _read_all(open_dataset(mixed[fmt], pair="image-image"))
    assert [(p.left, p.right) for p in images] == [(r["image"], r["image2"]) for r in rows]
    assert all(p.error is None for p in images)


def test_label_templates_are_checked_before_reading(mixed):
    for bad in ("This is a picture.", "{name} here", "{label", "{}"):
        with pytest.raises(UserError, match="label template"):
            open_dataset(mixed["wds"], pair="image-label", label_template=bad)
    # Other pair kinds ignore the template, so it is not their error.
    open_dataset(mixed["wds"], pair="image-text", label_template="no field")


def test_image_image_pairs_go_through_one_tower_end_to_end(mixed, fast_config, tmp_path):
    outs = {"wds": tmp_path / "wds.parquet", "parquet": tmp_path / "parquet.parquet"}
    score(open_dataset(mixed["wds"], pair="image-image"), outs["wds"], replace(fast_config, beta_k=16))
    beta = read_provenance(outs["wds"]).beta
    score(open_dataset(mixed["parquet"], pair="image-image"), outs["parquet"],
          replace(fast_config, beta_mode="fixed", beta=beta))
    a, b = (pq.read_table(outs[f]).to_pydict() for f in ("wds", "parquet"))
    assert a["key"] == b["key"] == [r["key"] for r in mixed["rows"]]
    np.testing.assert_allclose(a["sim"], b["sim"], atol=1e-6)
    sims = np.asarray(a["sim"])
    np.testing.assert_allclose(sims[0::2], 1.0, atol=1e-5)  # an image against itself, through the same tower
    assert (sims[1::2] < 1 - 1e-4).all()
    prov = read_provenance(outs["wds"])
    assert prov.pair == "image-image" and prov.beta_k == 16


def test_image_label_pairs_from_the_cli_with_a_template(mixed, fast_config, tmp_path, capsys):
    out = tmp_path / "labels.parquet"
    main(["score", mixed["parquet"], "--out", str(out), "--pair", "image-label", "--label-template",
          "a photo of a {label}.", "--model", "pairclean-tiny", "--pretrained", "none", "--beta-k", "16",
          "--batch-size", "4", "--workers", "0"])
    rows = pq.read_table(out).to_pydict()
    assert rows["error"][5] == "missing label" and rows["sim"][5] is None
    assert sum(e is None for e in rows["error"]) == 7
    # The template is part of the run's settings: the same label through another template scores differently.
    other = tmp_path / "other.parquet"
    spec = open_dataset(mixed["parquet"], pair="image-label", label_template="{label}")
    score(spec, other, replace(fast_config, beta_k=16))
    assert pq.read_table(other).column("sim").to_pylist()[0] != rows["sim"][0]
    with pytest.raises(SystemExit) as exc:
        main(["score", mixed["parquet"], "--out", str(tmp_path / "bad.parquet"), "--pair", "image-label",
              "--label-template", "a photo", "--model", "pairclean-tiny", "--pretrained", "none"])
    assert exc.value.code == 2 and "label template" in capsys.readouterr().err
    assert not Path(tmp_path / "bad.parquet").exists()


@pytest.mark.parametrize("kind", ["image-label", "image-image"])
def test_toy_pairs_carry_their_mismatches_in_a_truth_file(kind, tmp_path):
    main(["synth", "toy-pairs", kind, "--out", str(tmp_path / kind), "--pairs", "24", "--seed", "3", "--noise", "0.5",
          "--shard-size", "10"])
    read = open_dataset(str(tmp_path / kind / "manifest.yaml"))
    assert read.spec.pair == kind and len(read.spec.shards) == 3
    pairs = _read_all(read)
    truth = pq.read_table(read.spec.truth).to_pydict()
    assert [p.key for p in pairs] == truth["key"] and all(p.error is None for p in pairs)
    assert [p.shard for p in pairs] == truth["shard"] and [p.index for p in pairs] == truth["index"]
    own = [sample_scene(3, i) for i in range(24)]
    if kind == "image-label":
        mine = [f"This is a picture of {s.objects[0].shape}." for s in own]
        assert [p.right == m for p, m in zip(pairs, mine)] == [not n for n in truth["noisy"]]
        colours = build_toy_pairs(tmp_path / "colours", kind, 24, seed=3, label="colour")
        assert colours.truth is None
        assert [p.right for p in _read_all(colours)] == [f"This is a picture of {s.objects[0].colour}." for s in own]
    else:
        views = [png_bytes(render(second_view(s, 3, i))) for i, s in enumerate(own)]
        assert [p.right == v for p, v in zip(pairs, views)] == [not n for n in truth["noisy"]]
        assert all(p.left != p.right for p in pairs)  # a second view is another rendering
    assert sum(truth["selected"]) == 12 and 0 < sum(truth["noisy"]) <= 12
    with pytest.raises(UserError, match="noise must be within"):
        build_toy_pairs(tmp_path / "bad", kind, 10, noise=1.0)
