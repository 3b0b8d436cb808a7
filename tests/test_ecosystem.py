"""The data people have, made by the real tools (tests/data/ecosystem, each folder's PROVENANCE.md):
img2dataset's webdataset and Parquet output, Hugging Face `datasets` Parquet, clip-retrieval's
embeddings and a DataComp pool, each through score, filter, report, audit, corrupt and evaluate
with no hand-written glue. One test per friction of issue 24 (docs/ecosystem-layouts.md §5 numbers
them); only the command line and the files are used, so each also runs against older code.
"""

from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import exit_code, run_cli

ECO = Path(__file__).parent / "data" / "ecosystem"
I2D_WDS, I2D_PQ = ECO / "img2dataset" / "webdataset", ECO / "img2dataset" / "parquet"
HF_HUB, HF_PATHS = ECO / "hf-datasets" / "hub", ECO / "hf-datasets" / "path-only"
CLIP_RETRIEVAL, DATACOMP = ECO / "clip-retrieval", ECO / "datacomp"
TINY = ["--model", "pairclean-tiny", "--pretrained", "none", "--beta-k", "64", "--workers", "0", "--batch-size", "16"]
FIXED = ["--beta-mode", "fixed", "--beta", "0.0"]
FAILED_KEYS = ["000002", "000005", "000008", "000011", "000014", "000017"]  # img2dataset's 6 failed URLs


def score(source, out: Path, *extra) -> Path:
    code = exit_code(["score", *([source] if not isinstance(source, list) else source), "--out", out, *TINY, *extra])
    assert code == 0
    return out


def rows(path: Path) -> dict:
    return pq.read_table(path).to_pydict()


def tar_names(path: Path) -> list[str]:
    with tarfile.open(path) as tar:
        return [m.name for m in tar.getmembers()]


def tar_members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def audit_items(page: Path) -> list[dict]:
    """The pairs the audit page draws (one <article> each): their images, texts and note."""
    items = []
    for card in re.findall(r'<article class="pair[^"]*" hidden>(.*?)</article>', page.read_text(), re.S):
        texts = re.search(r'<div class="texts">(.*?)<p class="where">similarity', card, re.S).group(1)
        notes = re.findall(r'<p class="where">(.*?)</p>', texts)
        items.append({"images": re.findall(r'<img src="(data:image/[^"]+)"', card),
                      "texts": re.findall(r"<p>(.*?)</p>", texts), "note": notes[0] if notes else None})
    return items


@pytest.fixture(scope="module")
def i2d_wds_scores(tmp_path_factory) -> Path:
    return score(I2D_WDS, tmp_path_factory.mktemp("i2d-wds") / "scores.parquet")


@pytest.fixture(scope="module")
def i2d_pq_scores(tmp_path_factory) -> Path:
    return score(I2D_PQ, tmp_path_factory.mktemp("i2d-pq") / "scores.parquet")


@pytest.fixture(scope="module")
def clip_retrieval_scores(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cr") / "scores.parquet"
    assert exit_code(["score", CLIP_RETRIEVAL, "--from-embeddings", *FIXED, "--out", out]) == 0
    return out


@pytest.fixture(scope="module")
def datacomp_scores(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dc") / "scores.parquet"
    assert exit_code(["score", DATACOMP, "--from-embeddings", *FIXED, "--out", out]) == 0
    return out


# -- img2dataset ---------------------------------------------------------------------------------

def test_1_an_img2dataset_directory_is_scored_and_filtered_sidecars_and_all(i2d_wds_scores, tmp_path, capsys):
    scored = rows(i2d_wds_scores)
    assert len(scored["key"]) == 18 and sum(e is None for e in scored["error"]) == 12
    code, out, err = run_cli(["filter", I2D_WDS, "--scores", i2d_wds_scores, "--where", "sim IS NOT NULL",
                              "--dry-run"], capsys)
    assert code == 0 and "12" in out and "score them separately" not in err, err


def test_1_the_announcement_says_how_the_layout_is_read(tmp_path, capsys):
    code, out, _ = run_cli(["score", I2D_WDS, "--out", tmp_path / "s.parquet", *TINY], capsys)
    assert code == 0
    assert "reading img2dataset webdataset output: image=jpg;jpeg;png;webp, text=txt" in out
    assert "key=__key__; 2 tar file(s), 2 metadata sidecar(s)" in out


def test_2_failed_downloads_are_error_rows_with_img2datasets_reason(i2d_wds_scores):
    scored = rows(i2d_wds_scores)
    errors = {k: e for k, e in zip(scored["key"], scored["error"]) if e}
    assert sorted(errors) == FAILED_KEYS
    assert sorted(errors.values()) == sorted([
        "img2dataset failed_to_download: HTTP Error 404: File not found"] * 3 + [
        "img2dataset failed_to_download: timed out", "img2dataset failed_to_resize: Image decoding error",
        "img2dataset failed_to_download: <urlopen error [Errno 111] Connection refused>"])
    failed_shards = {Path(s).name for s, e in zip(scored["shard"], scored["error"]) if e}
    assert failed_shards == {"00000.parquet", "00001.parquet"}  # the sidecar row, not a tar position


def test_3_img2dataset_parquet_needs_no_flags_and_a_failed_run_blocks_nothing(tmp_path, capsys):
    out = tmp_path / "s.parquet"
    code, _, err = run_cli(["score", I2D_PQ, "--input-format", "parquet", "--out", out, *TINY], capsys)
    # refused before a model is built (issue 56: before, after the run, "column(s) ['image'] not in ...")
    assert code == 2 and "no column 'image' for the images (name it with --image-field" in err, err
    assert "its image columns: jpg" in err
    assert not out.exists() and not (tmp_path / "s.run.json").exists()
    code, out_text, err = run_cli(["score", I2D_PQ, "--out", out, *TINY], capsys)  # the corrected command
    assert code == 0, err
    assert "reading img2dataset Parquet output: image=jpg, text=caption, key=key" in out_text
    assert len(rows(out)["key"]) == 18


def test_4_img2dataset_parquet_failures_keep_img2datasets_reason(i2d_pq_scores):
    scored = rows(i2d_pq_scores)
    errors = {k: e for k, e in zip(scored["key"], scored["error"]) if e}
    assert sorted(errors) == FAILED_KEYS
    assert "missing image" not in errors.values()
    assert errors["000011"] == "img2dataset failed_to_download: HTTP Error 404: File not found"


def test_5_report_and_audit_read_the_dataset_the_scores_recorded(i2d_pq_scores, tmp_path, capsys):
    prov = pq.read_schema(i2d_pq_scores).metadata[b"pairclean"]
    dataset = json.loads(prov)["dataset"]
    assert dataset["format"] == "img2dataset-parquet" and dataset["fields"]["image"] == "jpg"
    assert dataset["key"] == "key" and dataset["sources"] == [str(I2D_PQ)]
    code, out, _ = run_cli(["report", i2d_pq_scores, "--out", tmp_path / "r.html"], capsys)
    assert code == 0 and "12 thumbnails" in out, out
    code, out, err = run_cli(["audit", i2d_pq_scores, "--out", tmp_path / "a.html", "--per-decile", "2"], capsys)
    assert code == 0, err
    items = audit_items(tmp_path / "a.html")
    assert items and all(item["images"] and item["texts"] and item["note"] is None for item in items)


def test_5_field_flags_still_override_what_was_recorded(i2d_pq_scores, tmp_path, capsys):
    code, _, err = run_cli(["report", i2d_pq_scores, "--out", tmp_path / "r.html", "--text-field", "url",
                              "--gallery", "2", "--contrast", "0"], capsys)
    assert code == 0, err
    assert "http://127.0.0.1" in (tmp_path / "r.html").read_text()  # the url column shown as the text


def test_6_filtered_img2dataset_parquet_is_scored_again_as_it_is(i2d_pq_scores, tmp_path, capsys):
    code, _, err = run_cli(["filter", i2d_pq_scores, "--where", "sim IS NOT NULL", "--out", tmp_path / "kept"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "kept").glob("shard-*")) == [
        "shard-000000.parquet", "shard-000000_stats.json", "shard-000001.parquet", "shard-000001_stats.json"]
    again = score(tmp_path / "kept", tmp_path / "again.parquet")
    assert len(rows(again)["key"]) == 12 and not any(rows(again)["error"])


# -- Hugging Face datasets -----------------------------------------------------------------------

def test_7_a_datasets_image_struct_is_read(tmp_path, capsys):
    out = score(HF_HUB / "data", tmp_path / "s.parquet")
    scored = rows(out)
    assert len(scored["key"]) == 16 and not any(scored["error"])
    ids = pq.read_table(sorted((HF_HUB / "data").glob("*.parquet"))).column("id").to_pylist()
    assert sorted(scored["key"]) == sorted(map(str, ids))  # keyed by the `id` column


def test_8_a_struct_read_as_a_path_fails_the_run_in_one_short_line(tmp_path, capsys):
    out = tmp_path / "s.parquet"
    code, _, err = run_cli(["score", HF_HUB / "data", "--out", out, "--text-field", "text", "--key-field", "id",
                            "--image-path-field", "image", *TINY], capsys)
    assert code == 2 and "every pair (16) is an error row" in err and not out.exists()
    manifest = json.loads((tmp_path / "s.run.json").read_text())
    reasons = [r["error"] for r in manifest["summary"]["error_reasons"]]
    assert reasons and all(len(r) < 300 and "\\x" not in r and "JFIF" not in r for r in reasons), reasons


def test_9_the_hub_layout_its_splits_and_path_only_images(tmp_path, capsys):
    code, out, err = run_cli(["score", HF_HUB, "--out", tmp_path / "all.parquet", *TINY], capsys)
    assert code == 0, err
    assert "all splits: test (1 file), train (2 files)" in out and len(rows(tmp_path / "all.parquet")["key"]) == 16
    assert len(rows(score(HF_HUB, tmp_path / "train.parquet", "--split", "train"))["key"]) == 12
    code, _, err = run_cli(["score", HF_HUB, "--split", "validation", "--out", tmp_path / "v.parquet", *TINY], capsys)
    assert code == 2 and "splits: test, train" in err
    path_only = rows(score(HF_PATHS, tmp_path / "paths.parquet"))  # images/NAME.jpg under the dataset root
    assert len(path_only["key"]) == 16 and not any(path_only["error"])


def test_9_a_parquet_written_by_datasets_now(tmp_path):
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    images = []
    for i in range(4):
        Image.new("RGB", (32, 32), (60 * i, 40, 200 - 40 * i)).save(tmp_path / f"{i}.png")
        images.append(str(tmp_path / f"{i}.png"))
    features = datasets.Features({"image": datasets.Image(), "caption": datasets.Value("string")})
    ds = datasets.Dataset.from_dict({"image": images, "caption": [f"a colour {i}" for i in range(4)]}, features=features)
    ds = ds.cast_column("image", datasets.Image(decode=True))
    (tmp_path / "out").mkdir()
    ds.with_format("arrow").map(datasets.table.embed_table_storage, batched=True).to_parquet(
        str(tmp_path / "out" / "train-00000-of-00001.parquet"))
    scored = rows(score(tmp_path / "out", tmp_path / "s.parquet"))
    assert len(scored["key"]) == 4 and not any(scored["error"])  # caption column found, keys by position


# -- clip-retrieval ------------------------------------------------------------------------------

def test_10_embedding_scores_drive_filter_report_and_audit_by_key(clip_retrieval_scores, tmp_path, capsys):
    code, out, err = run_cli(["filter", I2D_WDS, "--scores", clip_retrieval_scores, "--where", "sim > -1",
                              "--out", tmp_path / "kept"], capsys)
    assert code == 0, err
    kept = [n for shard in sorted((tmp_path / "kept").glob("*.tar")) for n in tar_names(shard)]
    assert len(kept) == 36  # 12 samples x jpg, json, txt
    code, out, _ = run_cli(["report", clip_retrieval_scores, "--shards", I2D_WDS, "--out", tmp_path / "r.html"], capsys)
    assert code == 0 and "12 thumbnails" in out, out
    code, _, err = run_cli(["audit", clip_retrieval_scores, "--shards", I2D_WDS, "--out", tmp_path / "a.html"], capsys)
    assert code == 0 and all(item["images"] for item in audit_items(tmp_path / "a.html")), err


def test_10_a_key_join_refuses_keys_that_repeat(clip_retrieval_scores, tmp_path, capsys):
    table = pq.read_table(clip_retrieval_scores)
    repeated = table.set_column(0, "key", pa.array(["000003"] * table.num_rows))  # every row one key
    pq.write_table(repeated.replace_schema_metadata(table.schema.metadata), tmp_path / "dup.parquet")
    code, _, err = run_cli(["filter", I2D_WDS, "--scores", tmp_path / "dup.parquet", "--where", "sim > -1",
                            "--dry-run"], capsys)
    assert code == 2 and "key '000003' is 12 rows" in err and "keys must then be unique" in err


# -- subsets and metadata ------------------------------------------------------------------------

def test_12_a_datacomp_uid_subset_keeps_what_datacomps_resharder_keeps(datacomp_scores, tmp_path, capsys):
    subset = DATACOMP / "subset" / "b32_top_half.npy"
    code, _, err = run_cli(["filter", datacomp_scores, "--keep-keys", subset, "--out", tmp_path / "kept",
                            "--prefix", "", "--keys-out", tmp_path / "kept-uids.npy"], capsys)
    assert code == 0, err
    ours = sorted(json.loads(data)["uid"] for t in (tmp_path / "kept").glob("*.tar")
                  for name, data in tar_members(t).items() if name.endswith(".json"))
    theirs = sorted(n.split("-")[0] for t in (DATACOMP / "resharded").glob("*.tar") for n in tar_names(t)
                    if n.endswith(".json"))
    assert ours == theirs and len(ours) == 7  # one uid of the subset was a failed download
    exported = np.load(tmp_path / "kept-uids.npy")
    assert exported.dtype == np.dtype("u8,u8") and len(exported) == 7 and (np.sort(exported) == exported).all()
    assert {f"{hi:016x}{lo:016x}" for hi, lo in exported.tolist()} == set(ours)
    stats = json.loads((tmp_path / "kept" / "00000000_stats.json").read_text())
    assert stats["successes"] == 7  # what DataComp's resharder sizes its input shards by


def test_12_metadata_in_predicates_and_queries(i2d_wds_scores, tmp_path, capsys):
    code, out, err = run_cli(["filter", I2D_WDS, "--scores", i2d_wds_scores, "--keys-out", tmp_path / "wide.txt",
                              "--where", "key IN (SELECT key FROM metadata WHERE original_width > 400)"], capsys)
    assert code == 0, err
    sidecars = pq.read_table(sorted(I2D_WDS.glob("*.parquet"))).to_pydict()
    wide = sorted(k for k, w in zip(sidecars["key"], sidecars["original_width"]) if w is not None and w > 400)
    assert (tmp_path / "wide.txt").read_text().split() == wide and 0 < len(wide) < 12
    sql = "SELECT count(*) AS n FROM scores s JOIN meta m USING (key) WHERE m.status = 'success'"
    code, out, err = run_cli(["query", i2d_wds_scores, sql, "--attach", f"meta={I2D_WDS}/*.parquet", "--format", "csv"],
                             capsys)
    assert code == 0 and out.split() == ['"n"', "12"], err


def test_12_an_attached_table_opens_no_other_file(i2d_wds_scores, tmp_path, capsys):
    other = I2D_PQ / "00000.parquet"
    for sql in (f"SELECT count(*) FROM read_parquet('{other}')", f"SELECT count(*) FROM '{other}'",
                f"SELECT * FROM read_csv('{ECO / 'img2dataset' / 'urls.csv'}')"):
        code, _, err = run_cli(["query", i2d_wds_scores, sql, "--attach", f"meta={I2D_WDS / '00000.parquet'}"], capsys)
        assert code == 2 and "Permission Error" in err, err
    code, _, err = run_cli(["query", i2d_wds_scores, "SELECT 1", "--attach", f"scores={other}"], capsys)
    assert code == 2 and "must be a plain identifier" in err


# -- DataComp ------------------------------------------------------------------------------------

def test_13_a_datacomp_pool_is_scored_from_its_shipped_embeddings(datacomp_scores, tmp_path, capsys):
    scored = rows(datacomp_scores)
    meta = pq.read_table(next((DATACOMP / "metadata").glob("*.parquet"))).to_pydict()
    assert scored["key"] == meta["uid"]  # keyed by uid, row i = metadata row i
    np.testing.assert_allclose(scored["sim"], meta["clip_b32_similarity_score"], atol=1e-3)
    code, _, err = run_cli(["filter", datacomp_scores, "--where", "sim IS NOT NULL", "--prefix", "",
                            "--out", tmp_path / "kept"], capsys)  # the pool's shards/ found from the scores
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "kept").glob("0*")) == [
        "00000000.parquet", "00000000.tar", "00000000_stats.json"]


# -- corrupt and filter output -------------------------------------------------------------------

def test_14_corrupt_changes_the_caption_wherever_it_is_read(tmp_path, capsys):
    assert exit_code(["corrupt", I2D_WDS, "--out", tmp_path / "noisy", "--ratio", "0.5", "--seed", "0"]) == 0
    truth = rows(tmp_path / "noisy" / "truth" / "truth.parquet")
    assert sum(truth["noisy"]) >= 3
    for shard in sorted((tmp_path / "noisy").glob("*.tar")):
        members = tar_members(shard)
        for name in (n for n in members if n.endswith(".txt")):
            assert members[name].decode() == json.loads(members[name[:-4] + ".json"])["caption"], name
    scored = score(tmp_path / "noisy", tmp_path / "json.parquet", "--text-field", "nosuch", "--json-text-key", "caption")
    code, out, err = run_cli(["evaluate", "detection", scored], capsys)  # the truth from the dataset scored
    assert code == 0 and f"{sum(truth['noisy'])} noisy" in out, err


def test_15_filter_output_has_img2datasets_shape(i2d_wds_scores, tmp_path, capsys):
    code, _, err = run_cli(["filter", i2d_wds_scores, "--where", "sim IS NOT NULL", "--prefix", "", "--shard-size", "7",
                            "--out", tmp_path / "kept"], capsys)
    assert code == 0, err
    kept = tmp_path / "kept"
    assert sorted(p.name for p in kept.iterdir() if p.name[0].isdigit()) == [
        "00000.parquet", "00000.tar", "00000_stats.json", "00001.parquet", "00001.tar", "00001_stats.json"]
    for number, size in (("00000", 7), ("00001", 5)):
        sidecar = rows(kept / f"{number}.parquet")
        keys = [n[:-4] for n in tar_names(kept / f"{number}.tar") if n.endswith(".jpg")]
        assert sidecar["key"] == keys and len(keys) == size and set(sidecar["status"]) == {"success"}
        assert json.loads((kept / f"{number}_stats.json").read_text())["successes"] == size
    again = rows(score(kept, tmp_path / "again.parquet"))
    assert len(again["key"]) == 12 and not any(again["error"])


# -- exit status ---------------------------------------------------------------------------------

def test_an_error_share_over_the_threshold_fails_the_run_and_writes_no_scores(tmp_path, capsys):
    out = tmp_path / "s.parquet"
    code, _, err = run_cli(["score", I2D_PQ, "--out", out, *TINY, "--max-error-share", "0.2"], capsys)
    assert code == 2 and "6 of 18 pairs (33.3%) are error rows, more than --max-error-share 0.2" in err
    assert not out.exists()
    assert exit_code(["score", I2D_PQ, "--out", out, *TINY, "--max-error-share", "0.5"]) == 0
