"""`corrupt --mode duplicate` plants copies of known kinds with truth, and `evaluate dedup` measures a
dedup against it: the copies on real toy-world and COCO caption shards, the metrics on a case
counted by hand, and the errors."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import run_cli
from PIL import Image

from pairclean.data.dataset import open_dataset
from pairclean.data.reading.tar import read_samples
from pairclean.data.spec import raise_failure
from pairclean.dedup.evaluation import KindEvaluation, evaluate_dedup
from pairclean.errors import ConfigError, UserError
from pairclean.calibrate.duplicates import plant_duplicates
from pairclean.lab.synth.world import OTHER_CAPTIONS, build_world


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("dupworld")
    build_world(root / "world", 120, shard_size=50, other_captions=3)
    return root / "world"


def samples(dataset) -> dict[str, dict]:
    return {s.key: s.members for shard in dataset.spec.shards for s in read_samples(shard, raise_failure)}


def test_every_kind_is_planted_with_its_truth(world, tmp_path):
    result = plant_duplicates(str(world), tmp_path / "dup", 0.25, seed=1, other_captions=world / OTHER_CAPTIONS)
    assert result.selected == 30 and result.pairs == 150
    by_kind = json.loads((tmp_path / "dup" / "corrupt.json").read_text())["copies_by_kind"]
    assert by_kind == {kind: 6 for kind in ("exact", "reencode", "resize", "crop", "caption")}
    source, copied = samples(open_dataset(str(world))), samples(open_dataset(str(tmp_path / "dup")))
    for key, members in source.items():  # the originals, byte for byte
        assert copied[key] == members
    other = {}
    for row in pq.read_table(world / OTHER_CAPTIONS).to_pylist():
        other.setdefault(row["key"], set()).add(row["caption"])
    truth = pq.read_table(result.truth).to_pylist()
    assert len(truth) == 150 and not any(r["noisy"] for r in truth)
    copies = [r for r in truth if r["dup_kind"] not in (None, "original")]
    originals = {r["dup_group"]: r for r in truth if r["dup_kind"] == "original"}
    assert len(copies) == 30 == len(originals)
    for row in copies:
        original = originals[row["dup_group"]]
        assert row["key"] == original["key"] + "-copy" and row["dup_of_index"] == original["index"]
        a, b = source[original["key"]], copied[row["key"]]
        image_a, image_b = (Image.open(io.BytesIO(m["png"])) for m in (a, b))
        if row["dup_kind"] == "exact":
            assert a == b and row["left_sha1"] == original["left_sha1"]
        elif row["dup_kind"] == "caption":
            assert a["png"] == b["png"] and b["txt"].decode() in other[original["key"]]
            assert row["right_sha1"] != original["right_sha1"]
        else:
            assert a["txt"] == b["txt"] and a["png"] != b["png"] and row["left_sha1"] != original["left_sha1"]
            size = {"reencode": (64, 64), "resize": (32, 32), "crop": (51, 51)}[row["dup_kind"]]
            assert image_a.size == (64, 64) and image_b.size == size
    again = plant_duplicates(str(world), tmp_path / "again", 0.25, seed=1, other_captions=world / OTHER_CAPTIONS)
    assert pq.read_table(again.truth).drop(["shard", "dup_of_shard"]).equals(
        pq.read_table(result.truth).drop(["shard", "dup_of_shard"]))  # seeded


def test_text_pairs_get_exact_copies_and_two_other_captions(tmp_path):
    from pairclean.lab.coco_text import OTHER_CAPTIONS as COCO_OTHERS, build_text_pairs

    annotations = [{"image_id": i, "caption": f"picture {i} caption {j}"} for i in range(20) for j in range(5)]
    (tmp_path / "captions.json").write_text(json.dumps({"annotations": annotations}))
    build_text_pairs(tmp_path / "captions.json", tmp_path / "pairs", shard_size=8)
    result = plant_duplicates(str(tmp_path / "pairs"), tmp_path / "dup", 0.5, other_captions=tmp_path / "pairs" / COCO_OTHERS)
    copied = samples(open_dataset(str(tmp_path / "dup")))
    kinds = {r["key"]: r["dup_kind"] for r in pq.read_table(result.truth).to_pylist()}
    assert sorted(k for k in kinds.values() if k not in (None, "original")) == ["caption"] * 5 + ["exact"] * 5
    for key, kind in kinds.items():
        if kind == "caption":
            original = copied[key[:-len("-copy")]]
            texts = {copied[key]["txt"].decode(), copied[key]["txt2"].decode()}
            assert len(texts) == 2 and not texts & {original["txt"].decode(), original["txt2"].decode()}
            assert all(t.startswith(f"picture {int(key[:12])} ") for t in texts)


def test_what_cannot_be_planted_is_refused(world, tmp_path, coco_parquet, capsys):
    with pytest.raises(ConfigError, match="other_captions"):
        plant_duplicates(str(world), tmp_path / "a", 0.1, kinds=("caption",))
    with pytest.raises(ConfigError, match="duplicate kind"):
        plant_duplicates(str(world), tmp_path / "b", 0.1, kinds=("blur",))
    with pytest.raises(UserError, match="WebDataset"):
        plant_duplicates(str(coco_parquet), tmp_path / "c", 0.1, kinds=("exact",))
    code, _, err = run_cli(["corrupt", world, "--out", tmp_path / "d", "--ratio", "0.1", "--mode", "duplicate",
                            "--kinds", "caption"], capsys)
    assert code == 2 and "--other-captions" in err
    code, _, err = run_cli(["corrupt", world, "--out", tmp_path / "e", "--ratio", "0.1", "--kinds", "exact"], capsys)
    assert code == 2 and "--mode duplicate" in err


def hand_case(tmp_path):
    """Eight rows: 0 + its resized copy 1 (found), 2 + its caption copy 3 (missed), 4 and 5 with
    one caption twice (the source's own duplicate), 6 and 7 unrelated (grouped by mistake)."""
    truth = pa.table({
        "key": [f"k{i}" for i in range(8)], "shard": ["s.tar"] * 8, "index": list(range(8)), "noisy": [False] * 8,
        "dup_group": [0, 0, 2, 2, None, None, None, None],
        "dup_kind": ["original", "resize", "original", "caption", None, None, None, None],
        "left_sha1": ["a", "b", "c", "c", "e", "f", "g", "h"], "right_sha1": ["1", "1", "2", "3", "4", "4", "5", "6"]})
    dedup = pa.table({"key": [f"k{i}" for i in range(8)], "shard": ["s.tar"] * 8, "index": list(range(8)),
                      "group_id": pa.array([0, 0, None, None, None, None, 6, 6], pa.int64()),
                      "kept": [True, False, True, True, True, True, True, False]})
    noise = pa.table({"key": [f"k{i}" for i in range(8)], "shard": ["other/s.tar"] * 8, "index": list(range(8)),
                      "noisy": [True] + [False] * 7})
    for name, table in (("truth", truth), ("dedup", dedup), ("noise", noise)):
        pq.write_table(table, tmp_path / f"{name}.parquet")
    return tmp_path / "dedup.parquet", tmp_path / "truth.parquet", tmp_path / "noise.parquet"


def test_metrics_on_a_case_counted_by_hand(tmp_path, capsys):
    dedup, truth, noise = hand_case(tmp_path)
    image = evaluate_dedup(dedup, truth, noise_truth=noise, side="image")
    assert (image.predicted_pairs, image.correct_pairs, image.true_pairs, image.found_pairs) == (2, 1, 2, 1)
    assert image.precision == image.recall == 50.0 and image.removed == 2
    assert image.kinds["resize"] == KindEvaluation(true_pairs=1, found=1, recall=100.0, precision=100.0)
    assert image.kinds["caption"] == KindEvaluation(true_pairs=1, found=0, recall=0.0, precision=None)
    assert "identical" not in image.kinds
    assert (image.planted_groups, image.planted_groups_found, image.planted_groups_one_kept) == (2, 1, 1)
    assert image.kept_noisy_share == 100.0 and image.noisy_share_in_groups == 50.0  # the noisy copy was kept
    assert image.noise_join == "shard file name, index"
    text = evaluate_dedup(dedup, truth, side="text")
    assert text.kinds["identical"] == KindEvaluation(true_pairs=1, found=0, recall=0.0, precision=None)
    assert text.true_pairs == 3 and text.recall == pytest.approx(100 / 3)
    # the world says rows 6 and 7 show the same thing: the pair grouped "by mistake" is a true one then
    pq.write_table(pq.read_table(truth).append_column("content", pa.array([None] * 6 + ["scene"] * 2)),
                   tmp_path / "content.parquet")
    content = evaluate_dedup(dedup, tmp_path / "content.parquet", side="image")
    assert content.kinds["same content"] == KindEvaluation(true_pairs=1, found=1, recall=100.0, precision=None)
    assert content.precision == 100.0 and content.correct_pairs == 2
    code, out, err = run_cli(["evaluate", "dedup", dedup, "--truth", truth, "--side", "both"], capsys)
    assert code == 0 and "resize" in out and (tmp_path / "dedup.evaluation.json").is_file()
    # --overwrite: the run above wrote dedup.evaluation.json, which is replaced only when asked
    code, _, err = run_cli(["evaluate", "dedup", dedup, "--truth", noise, "--overwrite"], capsys)
    assert code == 2 and "not a duplicates truth" in err
