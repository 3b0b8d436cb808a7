"""`pairclean corrupt`: row counts kept, exactly the changed pairs marked noisy, other members untouched."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import run_cli
from pairclean.cli import main
from pairclean.calibrate.corrupt import corrupt, weaken
from pairclean.errors import UserError
from pairclean.data.dataset import as_dataset, open_dataset
from pairclean.data.manifest import load_manifest
from pairclean.data.spec import Fields
from pairclean.data.writer import write_shards
from pairclean.ops.atomic import atomic_directory
from pairclean.data.reading.tar import read_samples
from pairclean.lab.synth.world import build_world


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """40 toy-world pairs in shards of 15, 15 and 10."""
    out = tmp_path_factory.mktemp("corrupt") / "world"
    build_world(out, 40, seed=5, shard_size=15)
    return out


def raw_samples(shard: str) -> list[dict]:
    failures: list = []
    samples = [{"__key__": s.key, **s.members} for s in read_samples(shard, failures.append)]
    assert not failures
    return samples


def pairs_of(source) -> list:
    dataset = as_dataset(source)
    return [p for unit in dataset.units() for p in dataset.read(unit)]


def truth_rows(path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def test_shuffle_keeps_rows_and_marks_exactly_the_changed_pairs(world, tmp_path):
    result = corrupt(str(world), tmp_path / "noisy", ratio=0.5, seed=3)
    before, after = pairs_of(str(world)), pairs_of(str(result.manifest))
    assert [(Path(p.shard).name, p.index, p.key) for p in before] == [(Path(p.shard).name, p.index, p.key) for p in after]
    for src in sorted(world.glob("*.tar")):  # same shard layout, same file names, same row count per shard
        assert len(raw_samples(str(src))) == len(raw_samples(str(result.out / src.name)))
    truth = truth_rows(result.truth)
    assert [(t["shard"], t["index"]) for t in truth] == [(str(result.out / Path(p.shard).name), p.index) for p in before]
    changed = [b.right != a.right for b, a in zip(before, after)]
    assert [t["noisy"] for t in truth] == changed
    assert [t["original_caption"] for t in truth] == [b.right for b in before]
    assert [t["caption"] for t in truth] == [a.right for a in after]
    assert sum(t["selected"] for t in truth) == result.selected == 20
    assert result.noisy == sum(changed) >= 18  # a drawn pair keeps its caption only by drawing itself
    # NCR: the selected captions are permuted among themselves
    selected = [i for i, t in enumerate(truth) if t["selected"]]
    assert sorted(before[i].right for i in selected) == sorted(after[i].right for i in selected)
    assert all(before[i].right == after[i].right for i in range(40) if i not in selected)
    for i in selected:  # the donor named in the truth gave the caption
        donor = next(j for j, t in enumerate(truth) if (t["shard"], t["index"]) == (truth[i]["donor_shard"], truth[i]["donor_index"]))
        assert after[i].right == before[donor].right


def test_shuffle_copies_every_other_member_byte_for_byte(world, tmp_path):
    result = corrupt(str(world), tmp_path / "noisy", ratio=1.0, seed=0)
    for src in sorted(world.glob("*.tar")):
        for a, b in zip(raw_samples(str(src)), raw_samples(str(result.out / src.name))):
            assert a.keys() == b.keys()
            assert a["__key__"] == b["__key__"]
            assert a["png"] == b["png"] and a["json"] == b["json"]


def test_manifest_points_at_the_truth_and_the_new_shards(world, tmp_path):
    result = corrupt(str(world / "manifest.yaml"), tmp_path / "noisy", ratio=0.2, seed=1)
    spec = load_manifest(result.manifest)
    assert Path(spec.truth) == result.truth
    assert [Path(s).name for s in spec.shards] == sorted(p.name for p in world.glob("*.tar"))
    assert spec.fields.image == "png"
    summary = json.loads((result.out / "corrupt.json").read_text())
    assert summary["selected"] == round(0.2 * 40) and summary["mode"] == "shuffle"


def test_same_seed_same_noise_other_seed_other_noise(world, tmp_path):
    a = truth_rows(corrupt(str(world), tmp_path / "a", ratio=0.3, seed=7).truth)
    b = truth_rows(corrupt(str(world), tmp_path / "b", ratio=0.3, seed=7).truth)
    c = truth_rows(corrupt(str(world), tmp_path / "c", ratio=0.3, seed=8).truth)
    strip = lambda rows: [(r["index"], r["noisy"], r["caption"]) for r in rows]  # noqa: E731
    assert strip(a) == strip(b)
    assert strip(a) != strip(c)


def test_a_pair_whose_caption_did_not_change_stays_clean(tmp_path):
    src = tmp_path / "dupes"
    with atomic_directory(src) as tmp:  # 8 pairs, only two distinct captions
        write_shards(({"__key__": f"k{i}", "txt": "same words" if i % 4 else "other words", "cls": str(i)}
                      for i in range(8)), tmp)
    dataset = open_dataset(str(src), pair="text-text", fields=Fields(text="cls", text2="txt"))
    result = corrupt(dataset, tmp_path / "out", ratio=1.0, seed=2)
    truth = truth_rows(result.truth)
    assert result.selected == 8
    assert [t["noisy"] for t in truth] == [t["caption"] != t["original_caption"] for t in truth]
    # Each 'other' caption that lands on a 'same' pair changes two pairs: 0, 2 or 4 of the 8 drawn.
    assert result.noisy in (0, 2, 4) and result.noisy < result.selected


def test_parquet_dataset_only_the_caption_column_changes(coco_parquet, tmp_path):
    result = corrupt(str(coco_parquet), tmp_path / "noisy", ratio=0.5, seed=4)
    original = pq.read_table(coco_parquet)
    copy = pq.read_table(result.out / coco_parquet.name)
    assert copy.schema.names == original.schema.names and copy.num_rows == original.num_rows == 16
    assert copy.column("image").equals(original.column("image"))
    assert copy.column("key").equals(original.column("key"))
    truth = truth_rows(result.truth)
    assert [t["noisy"] for t in truth] == [a != b for a, b in zip(original.column("caption").to_pylist(),
                                                                   copy.column("caption").to_pylist())]
    assert result.selected == 8 and result.noisy >= 6
    assert [t["index"] for t in truth] == list(range(16))


def test_weak_noise_replaces_about_thirty_percent_of_the_words(world, tmp_path):
    result = corrupt(str(world), tmp_path / "weak", ratio=0.5, seed=1, mode="weak")
    truth = truth_rows(result.truth)
    assert result.selected == result.noisy == 20
    for t in truth:
        if not t["noisy"]:
            assert t["caption"] == t["original_caption"]
            continue
        old, new = t["original_caption"].split(), t["caption"].split()
        assert len(old) == len(new)
        assert sum(a != b for a, b in zip(old, new)) == max(1, round(0.3 * len(old)))
        assert t["donor_shard"] is None


def test_weaken_never_keeps_a_replaced_word():
    rng = np.random.default_rng(0)
    vocabulary = ["a", "b"]
    index = {w: i for i, w in enumerate(vocabulary)}
    for _ in range(20):
        assert weaken("a a a a", vocabulary, index, rng, share=1.0) == "b b b b"


def test_refusals(world, tmp_path, coco_src):
    with pytest.raises(UserError, match="ratio"):
        corrupt(str(world), tmp_path / "x", ratio=1.5)
    with pytest.raises(UserError, match="noise mode"):
        corrupt(str(world), tmp_path / "x", ratio=0.5, mode="swap")
    with pytest.raises(UserError, match="have none"):
        corrupt(open_dataset(str(world), pair="image-image"), tmp_path / "x", ratio=0.5)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(UserError, match="not empty"):
        corrupt(str(world), tmp_path / "full", ratio=0.5)


def test_cli_corrupt_writes_dataset_and_truth(world, tmp_path, capsys):
    out = tmp_path / "cli"
    main(["corrupt", str(world), "--out", str(out), "--ratio", "0.25", "--seed", "9"])
    printed = capsys.readouterr().out
    assert "truth" in printed and str(out) in printed.replace("\n", "")
    noisy = duckdb.sql(f"SELECT count(*) FILTER (WHERE selected), count(*) FROM '{out}/truth/truth.parquet'").fetchall()[0]
    assert noisy == (10, 40)


def test_mixed_noise_weakens_and_shuffles_disjoint_draws(world, tmp_path):
    result = corrupt(str(world), tmp_path / "mixed", ratio=0.3, seed=2, mode="mixed", weak_ratio=0.25)
    truth = truth_rows(result.truth)
    assert len(truth) == len(pairs_of(str(result.manifest))) == 40
    shuffled = [t for t in truth if t["donor_shard"] is not None]
    weakened = [t for t in truth if t["selected"] and t["donor_shard"] is None]
    assert len(shuffled) == 12 and len(weakened) == 10 and result.selected == 22  # disjoint: 12 + 10 drawn
    assert {t["noise"] for t in weakened} == {"weak"}
    assert {t["noise"] for t in shuffled if t["noisy"]} == {"shuffle"}
    assert all((t["noise"] == "clean") == (not t["noisy"]) for t in truth)
    donors = {(t["donor_shard"], t["donor_index"]) for t in shuffled}
    assert donors == {(t["shard"], t["index"]) for t in shuffled}  # permuted among the shuffled draw only
    for t in weakened:
        old, new = t["original_caption"].split(), t["caption"].split()
        assert sum(a != b for a, b in zip(old, new)) == max(1, round(0.3 * len(old)))
    kinds = dict(duckdb.sql(f"SELECT noise, count(*) FROM '{result.truth}' GROUP BY noise").fetchall())
    assert kinds["weak"] == 10 and kinds["clean"] == 40 - result.noisy


def test_mixed_noise_keeps_the_shuffle_draw_of_the_same_seed(world, tmp_path):
    plain = truth_rows(corrupt(str(world), tmp_path / "s", ratio=0.3, seed=2).truth)
    mixed = truth_rows(corrupt(str(world), tmp_path / "m", ratio=0.3, seed=2, mode="mixed", weak_ratio=0.2).truth)
    assert [t["caption"] for t in plain if t["noise"] == "shuffle"] == \
        [t["caption"] for t in mixed if t["noise"] == "shuffle"]


def test_mixed_noise_refusals(world, tmp_path):
    with pytest.raises(UserError, match="weak_ratio"):
        corrupt(str(world), tmp_path / "x", ratio=0.3, mode="mixed")
    with pytest.raises(UserError, match="weak_ratio"):
        corrupt(str(world), tmp_path / "x", ratio=0.3, weak_ratio=0.2)
    with pytest.raises(UserError, match="at most 1"):
        corrupt(str(world), tmp_path / "x", ratio=0.6, mode="mixed", weak_ratio=0.5)


def test_cli_corrupt_mixed(world, tmp_path):
    out = tmp_path / "cli-mixed"
    main(["corrupt", str(world), "--out", str(out), "--mode", "mixed", "--ratio", "0.25", "--weak-ratio", "0.25"])
    kinds = dict(duckdb.sql(f"SELECT noise, count(*) FROM '{out}/truth/truth.parquet' WHERE selected "
                            "GROUP BY noise").fetchall())
    assert kinds["weak"] == 10 and kinds.get("shuffle", 0) + kinds.get("clean", 0) == 10


# -- hard noise: the caption of the nearest other item ---------------------------------------------


def _tfidf_nearest(texts: list[str], captions: list[str]) -> list[int]:
    """The reference: the nearest other item by TF-IDF cosine with a different caption, from the full matrix."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.metrics.pairwise import cosine_similarity

    sims = cosine_similarity(TfidfVectorizer().fit_transform(texts))
    nearest = []
    for i, row in enumerate(sims):
        order = sorted(range(len(row)), key=lambda j: (-round(row[j], 9), j))
        nearest.append(next(j for j in order if j != i and captions[j] != captions[i]))
    return nearest


def test_hard_noise_takes_the_nearest_other_caption_and_records_the_donor(coco_shards, tmp_path):
    result = corrupt(str(coco_shards), tmp_path / "hard", ratio=0.5, seed=2, mode="hard")
    before, after = pairs_of(str(coco_shards)), pairs_of(str(result.manifest))
    truth = truth_rows(result.truth)
    assert result.selected == result.noisy == 8
    assert [t["noisy"] for t in truth] == [b.right != a.right for b, a in zip(before, after)]
    captions = [p.right for p in before]
    nearest = _tfidf_nearest(captions, captions)
    where = {(str(result.out / Path(p.shard).name), p.index): i for i, p in enumerate(before)}
    for i, t in enumerate(truth):
        if t["noisy"]:
            donor = where[(t["donor_shard"], t["donor_index"])]
            assert donor == nearest[i] and t["caption"] == captions[donor] != t["original_caption"]
        else:
            assert t["donor_shard"] is None and t["donor_index"] is None and t["caption"] == t["original_caption"]
    for src in sorted(coco_shards.glob("*.tar")):  # the images are byte-identical
        copies = {s["__key__"]: s for s in raw_samples(str(result.out / src.name))}
        for sample in raw_samples(str(src)):
            assert sample["jpg"] == copies[sample["__key__"]]["jpg"]


def test_hard_noise_on_text_text_parquet_compares_both_texts(coco_src, tmp_path):
    rows = [json.loads(line) for line in (coco_src / "pairs.jsonl").read_text().splitlines()]
    path = tmp_path / "text.parquet"
    pq.write_table(pa.table({"key": [str(r["image_id"]) for r in rows], "caption": [r["captions"][0] for r in rows],
                             "caption2": [r["captions"][1] for r in rows]}), path)
    spec = open_dataset(str(path), pair="text-text")
    result = corrupt(spec, tmp_path / "hard", ratio=0.25, seed=0, mode="hard")
    truth = truth_rows(result.truth)
    copy = pq.read_table(result.out / path.name)
    assert copy.column("caption").to_pylist() == [r["captions"][0] for r in rows]  # the first text never changes
    seconds = [r["captions"][1] for r in rows]
    nearest = _tfidf_nearest([f"{r['captions'][0]} {r['captions'][1]}" for r in rows], seconds)
    assert result.noisy == 4
    for i, t in enumerate(truth):
        assert copy.column("caption2")[i].as_py() == t["caption"]
        if t["noisy"]:
            assert t["donor_index"] == nearest[i] and t["caption"] == seconds[nearest[i]]


def test_hard_noise_from_the_cli(coco_shards, tmp_path, capsys):
    code = main(["corrupt", str(coco_shards), "--out", str(tmp_path / "hard"), "--ratio", "0.25", "--mode", "hard"])
    assert code in (0, None)
    assert "4 noisy" in capsys.readouterr().out


def test_cli_counts_in_words_a_person_writes(tmp_path, capsys):
    """Two pairs at 50%: one drawn, and a shuffle of one caption gives it back its own."""
    build_world(tmp_path / "two", 2, seed=0)
    code, out, err = run_cli(["corrupt", tmp_path / "two", "--out", tmp_path / "half", "--ratio", "0.5"], capsys)
    out = out.replace("\n", "")
    assert code == 0 and "2 pairs copied to" in out and "1 drawn, 0 noisy (1 drawn pair kept its caption)" in out, err
    code, out, err = run_cli(["corrupt", tmp_path / "two", "--out", tmp_path / "all", "--ratio", "1"], capsys)
    assert code == 0 and "2 drawn, 2 noisy" in out.replace("\n", "") and "kept" not in out, err


def test_a_pair_kind_hint_does_not_ask_to_repair_the_shard(world, tmp_path, capsys):
    """Text-text columns read as image-text: the fix is --pair, not the file; a truncated shard is repaired."""
    path = tmp_path / "texts.parquet"
    pq.write_table(pa.table({"key": ["a", "b"], "caption": ["one", "two"], "caption2": ["uno", "dos"]}), path)
    code, _, err = run_cli(["corrupt", path, "--out", tmp_path / "noisy", "--ratio", "0.5"], capsys)
    assert code == 2 and err.rstrip().endswith("its columns fit --pair text-text") and "repair" not in err
    cut = tmp_path / "cut.tar"
    cut.write_bytes(sorted(world.glob("*.tar"))[0].read_bytes()[:700])
    code, _, err = run_cli(["corrupt", cut, "--out", tmp_path / "noisy2", "--ratio", "0.5"], capsys)
    assert code == 2 and "so repair that shard or leave it out" in err


def test_truth_may_be_the_directory_corrupt_wrote(world, tmp_path, coco_shards, capsys):
    """`--truth noisy/`: the manifest in it says where the truth is (query, evaluate detection)."""
    from helpers import tiny_scores

    noisy = tmp_path / "noisy"
    corrupt(str(world), noisy, ratio=0.5, seed=0)
    scores = tiny_scores(noisy, tmp_path / "scores.parquet")
    code, out, err = run_cli(["evaluate", "detection", scores, "--truth", f"{noisy}/"], capsys)
    assert code == 0 and "20 noisy" in out, err
    code, out, err = run_cli(["query", scores, "SELECT count(*) FILTER (WHERE noisy) FROM labeled", "--truth", noisy,
                              "--format", "csv"], capsys)
    assert code == 0 and out.splitlines()[1:] == ["20"], err
    code, _, err = run_cli(["evaluate", "detection", scores, "--truth", world], capsys)
    assert code == 2 and "names no truth file" in err
    code, _, err = run_cli(["evaluate", "detection", scores, "--truth", tmp_path / "empty"], capsys)
    assert code == 2 and "truth file not found" in err
