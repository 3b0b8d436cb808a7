"""Hardening III (issue 33): what a scores file or a saved run records is an input too.

One test (or one parametrised group) per case of the issue, each through the command line and the
files alone, so that it also runs against the code before (a6e2769), where every one of them fails.
The classes and their mechanisms are in docs/reliability.md ("Hardening III").
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import exit_code, forked, refused, run_cli
from PIL import Image

from pairclean.cli import main

ECO = Path(__file__).parent / "data" / "ecosystem"
I2D_WDS, DATACOMP = ECO / "img2dataset" / "webdataset", ECO / "datacomp"
TINY = ["--model", "pairclean-tiny", "--pretrained", "none", "--beta-k", "64", "--workers", "0", "--batch-size", "8"]
FIXED = ["--beta-mode", "fixed", "--beta", "0.0"]


def scored(source, out: Path, *extra, capsys=None) -> Path:
    """Score with the tiny model; what it printed is dropped (`capsys`), so the next command's is its own."""
    assert exit_code(["score", source, "--out", out, *TINY, *extra]) == 0
    if capsys is not None:
        capsys.readouterr()
    return out


def one_line_error(code: int, err: str, *words: str) -> None:
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    for word in words:
        assert word in err, err


def run_summary(scores: Path) -> dict:
    """The summary of the run manifest beside a scores file (as every version writes it)."""
    return json.loads(scores.with_name(scores.stem + ".run.json").read_text())["summary"]


def tar_samples(path: Path) -> list[list[tuple[tarfile.TarInfo, bytes]]]:
    """The tar's members grouped by key, in order, with their bytes."""
    samples: list[list[tuple[tarfile.TarInfo, bytes]]] = []
    with tarfile.open(path) as tar:
        for info in tar.getmembers():
            key = info.name.split(".")[0]
            if not samples or samples[-1][0][0].name.split(".")[0] != key:
                samples.append([])
            samples[-1].append((info, tar.extractfile(info).read()))
    return samples


def write_tar(path: Path, samples) -> None:
    with tarfile.open(path, "w") as tar:
        for sample in samples:
            for info, data in sample:
                tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory, coco_shards) -> Path:
    """A complete `score --save-embeddings` directory of the 16 COCO pairs (3 blocks)."""
    root = tmp_path_factory.mktemp("saved")
    scored(coco_shards, root / "s.parquet", "--save-embeddings", root / "emb")
    return root / "emb"


# -- recorded dataset and saved runs -------------------------------------------------------------


def test_case_1_report_and_audit_refuse_a_shard_changed_since_scoring(coco_shards, tmp_path, capsys):
    """The same samples in reverse order, the same size: every position now holds another pair."""
    shards = Path(shutil.copytree(coco_shards, tmp_path / "shards"))
    scores = scored(shards, tmp_path / "s.parquet", capsys=capsys)
    first = sorted(shards.glob("*.tar"))[0]
    size = first.stat().st_size
    write_tar(first, reversed(tar_samples(first)))
    assert first.stat().st_size == size
    for argv in (["report", scores, "--out", tmp_path / "r.html"],
                 ["audit", scores, "--out", tmp_path / "a.html", "--per-decile", "2"]):
        code, _, err = run_cli(argv, capsys)
        one_line_error(code, err, first.name, "changed since it was scored")
    assert not (tmp_path / "r.html").exists() and not (tmp_path / "a.html").exists()


def test_case_2_filter_never_writes_into_the_recorded_dataset(tmp_path, capsys):
    data = Path(shutil.copytree(I2D_WDS, tmp_path / "download"))
    scores = scored(data, tmp_path / "s.parquet", capsys=capsys)
    keep = ["--where", "sim IS NOT NULL"]
    refused(["filter", scores, *keep, "--keys-out", data / "00000.parquet", "--overwrite"], capsys, data,
            message="input")
    refused(["filter", scores, *keep, "--keys-out", data / "kept.parquet"], capsys, data, message="input")
    refused(["filter", scores, *keep, "--out", data / "kept"], capsys, data, message="input")
    assert sorted(p.name for p in data.iterdir()) == sorted(p.name for p in I2D_WDS.iterdir())


def test_case_3_an_unfinished_saved_embeddings_directory_is_refused(coco_shards, tmp_path, capsys):
    emb = tmp_path / "emb"
    argv = ["score", coco_shards, "--out", tmp_path / "s.parquet", "--save-embeddings", emb, *TINY]
    assert forked(lambda: main([str(a) for a in argv]), "committed:1") == -signal.SIGKILL
    capsys.readouterr()
    assert len(list((emb / "img_emb").glob("*.npy"))) == 1 and not (emb / "provenance.json").exists()
    code, _, err = run_cli(["dedup", emb, "--out", tmp_path / "d.parquet", "--keep", "semdedup"], capsys)
    one_line_error(code, err, str(emb), "unfinished")
    code, _, err = run_cli(["score", emb, "--from-embeddings", *FIXED, "--out", tmp_path / "e.parquet"], capsys)
    one_line_error(code, err, str(emb), "unfinished")
    assert not (tmp_path / "d.parquet").exists() and not (tmp_path / "e.parquet").exists()


def test_case_4_resuming_a_save_from_another_directory_is_refused(coco_shards, tmp_path, monkeypatch, capsys):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    argv = ["score", coco_shards, "--out", tmp_path / "s.parquet", "--save-embeddings", "emb", *TINY]
    monkeypatch.chdir(first)
    assert forked(lambda: main([str(a) for a in argv]), "committed:1") == -signal.SIGKILL
    capsys.readouterr()
    monkeypatch.chdir(second)
    code, _, err = run_cli(argv, capsys)
    one_line_error(code, err, "save_embeddings", str(first / "emb"), str(second / "emb"))
    assert not (second / "emb").exists()


def test_case_4_a_saved_directory_missing_a_block_is_refused(saved_dir, tmp_path, capsys):
    emb = Path(shutil.copytree(saved_dir, tmp_path / "emb"))
    for sub, name in (("img_emb", "img_emb_1.npy"), ("text_emb", "text_emb_1.npy"), ("metadata", "metadata_1.parquet")):
        (emb / sub / name).unlink()
    code, _, err = run_cli(["score", emb, "--from-embeddings", *FIXED, "--out", tmp_path / "e.parquet"], capsys)
    one_line_error(code, err, "provenance.json", "block 1")
    assert not (tmp_path / "e.parquet").exists()


@pytest.mark.parametrize("edit,field", [
    (lambda p: p["beta"].update(beta=float("nan")), "beta.beta"),
    (lambda p: p["beta"].update(beta="0.3"), "beta.beta"),
    (lambda p: p.update(extra=1), "extra"),
    (lambda p: p["beta"].update(extra=1), "beta.extra"),
    (lambda p: p.update(pair=5), "pair"),
    (lambda p: p.update(rows=-1), "rows"),
    (lambda p: [p], "got a list"),
], ids=["beta-nan", "beta-string", "unknown-key", "unknown-beta-key", "pair-number", "rows-negative", "list"])
def test_case_5_provenance_json_is_read_as_strictly_as_a_flag(saved_dir, tmp_path, capsys, edit, field):
    emb = Path(shutil.copytree(saved_dir, tmp_path / "emb"))
    provenance = json.loads((emb / "provenance.json").read_text())
    edited = edit(provenance)
    (emb / "provenance.json").write_text(json.dumps(edited if edited is not None else provenance))
    code, _, err = run_cli(["score", emb, "--from-embeddings", "--out", tmp_path / "e.parquet"], capsys)
    one_line_error(code, err, str(emb / "provenance.json"), field)
    assert not (tmp_path / "e.parquet").exists()


def _reencoded(directory: Path) -> None:
    """Another download of the same URLs: img2dataset names its shards and keys alike, the images differ."""
    for tar in sorted(directory.glob("*.tar")):
        samples = []
        for sample in tar_samples(tar):
            members = []
            for info, data in sample:
                if info.name.endswith(".jpg"):
                    buf = io.BytesIO()
                    Image.open(io.BytesIO(data)).convert("RGB").save(buf, format="JPEG", quality=20)
                    data = buf.getvalue()
                    info.size = len(data)
                members.append((info, data))
            samples.append(members)
        write_tar(tar, samples)


@pytest.fixture(scope="module")
def two_downloads(tmp_path_factory):
    root = tmp_path_factory.mktemp("downloads")
    first, second = Path(shutil.copytree(I2D_WDS, root / "a")), Path(shutil.copytree(I2D_WDS, root / "b"))
    _reencoded(second)
    scores_first = scored(first, root / "a.parquet")
    scored(second, root / "b.parquet", "--save-embeddings", root / "b-emb")
    return first, second, scores_first, root / "b-emb"


def test_case_6_dedup_refuses_the_scores_of_another_download(two_downloads, tmp_path, capsys):
    _, _, scores_first, embeddings_second = two_downloads
    argv = ["dedup", embeddings_second, "--scores", scores_first, "--out", tmp_path / "d.parquet"]
    code, _, err = run_cli(argv, capsys)
    one_line_error(code, err, "--allow-other-dataset")
    assert not (tmp_path / "d.parquet").exists()
    assert exit_code([*argv, "--allow-other-dataset"]) == 0


def test_case_6_filter_refuses_the_scores_of_another_download(two_downloads, tmp_path, capsys):
    _, second, scores_first, _ = two_downloads
    argv = ["filter", second, "--scores", scores_first, "--where", "sim IS NOT NULL", "--out", tmp_path / "k"]
    code, _, err = run_cli(argv, capsys)
    one_line_error(code, err, "--allow-other-dataset", "00000.tar")
    assert not (tmp_path / "k").exists()
    assert exit_code([*argv, "--allow-other-dataset"]) == 0


@pytest.mark.parametrize("method", [["--weights"], ["--filter", "sim IS NOT NULL", "--scores"]],
                         ids=["weights", "filter"])
def test_train_refuses_the_scores_of_another_download_as_filter_does(two_downloads, tmp_path, capsys, method):
    """Issue 55: `train --weights S` and `train --scores S --filter` joined the scores of another
    copy whose keys collide, exit 0 and no word; `filter` refused the same pair of files."""
    _, second, scores_first, _ = two_downloads
    argv = ["train", second, *method, scores_first, "--out", tmp_path / "run", "--model", "pairclean-tiny",
            "--pretrained", "none", "--epochs", "1", "--batch-size", "8", "--workers", "0"]
    code, _, err = run_cli(argv, capsys)
    one_line_error(code, err, "--allow-other-dataset", "00000.tar", "the training shards")
    assert not (tmp_path / "run" / "weights").exists()
    assert exit_code([*argv, "--allow-other-dataset"]) == 0


# -- outputs of one run --------------------------------------------------------------------------


def test_case_7_outputs_of_one_run_never_overlap(coco_shards, coco_scores, tmp_path, capsys):
    out = tmp_path / "s.parquet"
    refused(["score", coco_shards, "--out", out, "--save-embeddings", f"{out}.parts", *TINY], capsys, coco_shards,
            message="--save-embeddings")
    assert not out.exists() and not Path(f"{out}.parts").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    refused(["filter", coco_scores, "--where", "sim IS NOT NULL", "--out", kept, "--keys-out", kept / "keys.txt",
             "--overwrite"], capsys, coco_scores, message="--keys-out")
    assert list(kept.iterdir()) == []


def test_case_8_a_filter_that_keeps_nothing_writes_nothing(tmp_path, capsys):
    """docs/ecosystem.md's DataComp recipe, with a predicate that keeps no pair, then corrected."""
    scores = tmp_path / "dc.parquet"
    assert exit_code(["score", DATACOMP, "--from-embeddings", *FIXED, "--out", scores]) == 0
    capsys.readouterr()
    recipe = ["filter", scores, "--out", tmp_path / "kept-dc", "--prefix", "", "--keys-out", tmp_path / "kept-dc-uids.npy"]
    for argv in ([*recipe, "--where", "sim > 2"], ["filter", scores, "--where", "sim > 2", "--keys-out",
                                                    tmp_path / "kept-dc-uids.npy"]):
        code, _, err = run_cli(argv, capsys)
        one_line_error(code, err, "nothing written")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["dc.parquet", "dc.run.json"]
    assert exit_code([*recipe, "--where", "sim > -2"]) == 0
    assert (tmp_path / "kept-dc-uids.npy").is_file() and (tmp_path / "kept-dc").is_dir()


# -- readers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("broken", ["00001.parquet", "00000.parquet"], ids=["second-sidecar", "first-sidecar"])
def test_case_9_a_truncated_sidecar_is_a_failed_unit(tmp_path, capsys, broken):
    data = Path(shutil.copytree(I2D_WDS, tmp_path / "download"))
    sidecar = data / broken
    sidecar.write_bytes(sidecar.read_bytes()[: sidecar.stat().st_size // 2])
    scores = tmp_path / "s.parquet"
    code, out, err = run_cli(["score", data, "--out", scores, *TINY], capsys)
    assert code == 0, err
    assert "reading img2dataset webdataset output" in out
    failures = run_summary(scores)["unit_failures"]
    assert len(failures) == 1 and failures[0]["unit"].endswith(broken.replace(".parquet", ".tar"))
    assert "sidecar" in failures[0]["reason"]


def test_case_10_an_image_struct_without_a_file_is_an_error_row(coco_src, tmp_path, capsys):
    """Hugging Face Image structs {bytes: null, path: ""} and one naming a folder."""
    root = tmp_path / "hf"
    (root / "a-folder").mkdir(parents=True)
    images = [p.read_bytes() for p in sorted((coco_src / "val2017").glob("*.jpg"))[:3]]
    structs = [{"bytes": data, "path": None} for data in images] + [{"bytes": None, "path": ""},
                                                                    {"bytes": None, "path": "a-folder"}]
    features = {"image": {"_type": "Image"}, "text": {"dtype": "string", "_type": "Value"},
                "id": {"dtype": "string", "_type": "Value"}}
    table = pa.table({"image": pa.array(structs, pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
                      "text": [f"caption {i}" for i in range(5)], "id": [f"r{i}" for i in range(5)]})
    table = table.replace_schema_metadata({b"huggingface": json.dumps({"info": {"features": features}}).encode()})
    pq.write_table(table, root / "train.parquet")
    scores = tmp_path / "s.parquet"
    code, _, err = run_cli(["score", root / "train.parquet", "--out", scores, *TINY], capsys)
    assert code == 0, err
    rows = pq.read_table(scores, columns=["key", "error"]).to_pydict()
    errors = dict(zip(rows["key"], rows["error"]))
    assert [errors[f"r{i}"] for i in range(3)] == [None] * 3
    assert errors["r3"] and errors["r4"] and "a-folder" in errors["r4"]


def _npy_bytes(shape: tuple[int, int], rows_stored: int, seed: int) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": shape})
    data = np.random.default_rng(seed).standard_normal((rows_stored, shape[1])).astype("<f4")
    return buf.getvalue() + data.tobytes()


def test_case_11_an_npz_member_shorter_than_its_header_is_refused(tmp_path, capsys):
    """b32_img's header declares 200 rows and stores 100: rows 100-199 would be read from b32_txt."""
    npz = tmp_path / "metadata" / "0123abcd.npz"
    npz.parent.mkdir()
    with zipfile.ZipFile(npz, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("b32_img.npy", _npy_bytes((200, 8), 100, 0))
        archive.writestr("b32_txt.npy", _npy_bytes((200, 8), 200, 1))
    for argv in (["score", npz, "--from-embeddings", *FIXED, "--out", tmp_path / "s.parquet"],
                 ["dedup", npz, "--keep", "semdedup", "--out", tmp_path / "d.parquet"]):
        code, _, err = run_cli(argv, capsys)
        one_line_error(code, err, "b32_img", "200")
    assert not (tmp_path / "s.parquet").exists() and not (tmp_path / "d.parquet").exists()


@pytest.mark.parametrize("how", ["glob", "list"])
def test_case_12_a_fifo_among_the_shards_is_refused_not_opened(coco_shards, tmp_path, how):
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(sorted(coco_shards.glob("*.tar"))[0], data / "aa.tar")
    os.mkfifo(data / "zz.tar")
    if how == "glob":
        source = f"{data}/*.tar"
    else:
        source = tmp_path / "shards.txt"
        source.write_text("data/aa.tar\ndata/zz.tar\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.run([sys.executable, "-m", "pairclean", "score", str(source), "--out", str(tmp_path / "s.parquet"),
                           *TINY], capture_output=True, text=True, timeout=180, env=env)
    one_line_error(proc.returncode, proc.stderr, "zz.tar", "not a regular file")
    assert not (tmp_path / "s.parquet").exists()


def test_case_13_a_forced_format_that_reads_none_of_the_files_is_one_line(coco_shards, tmp_path, capsys):
    code, _, err = run_cli(["score", f"{coco_shards}/*.tar", "--input-format", "hf-parquet", "--out",
                            tmp_path / "s.parquet", *TINY], capsys)
    one_line_error(code, err, "Hugging Face")


def test_case_14_embeddings_with_no_columns_are_refused(tmp_path, capsys):
    left, right = tmp_path / "left.npy", tmp_path / "right.npy"
    np.save(left, np.zeros((12, 0), np.float32))
    np.save(right, np.zeros((12, 0), np.float32))
    for argv in (["score", left, right, "--from-embeddings", *FIXED, "--out", tmp_path / "s.parquet"],
                 ["dedup", left, right, "--keep", "semdedup", "--out", tmp_path / "d.parquet"]):
        code, _, err = run_cli(argv, capsys)
        one_line_error(code, err, "left.npy", "0 values")


# -- keys and layouts ----------------------------------------------------------------------------

AWKWARD_KEYS = ["plain", " leading", "trailing ", "two  spaces", "line\u2028separator", "next\u0085line",
                "file\x1cseparator", "tab\tinside", "carriage\rreturn", "new\nline", "\ufeffbom", "", "x"]


@pytest.mark.parametrize("suffix", [".txt", ".parquet"])
def test_case_15_keys_out_reads_back_as_the_same_set(tmp_path, suffix):
    from pairclean.data.keys import read_keys, write_keys
    from pairclean.errors import UserError

    path = tmp_path / f"keys{suffix}"
    writable = []
    for key in AWKWARD_KEYS:
        try:
            write_keys(path, ["plain", key])
        except UserError as exc:
            assert len(str(exc).splitlines()) == 1 and suffix == ".txt"
            continue
        assert set(read_keys(path).to_pylist()) == {"plain", key}, repr(key)
        writable.append(key)
    assert "new\nline" not in writable if suffix == ".txt" else writable == AWKWARD_KEYS
    assert {" leading", "trailing ", "line\u2028separator", "next\u0085line", "file\x1cseparator"} <= set(writable)


def test_case_15_a_uid_list_holds_datacomps_uids_only(tmp_path):
    from pairclean.data.keys import read_keys, write_keys
    from pairclean.errors import UserError

    uids = ["0123456789abcdef0123456789abcdef", "00000000000000000000000000000001", "f" * 32]
    path = tmp_path / "keys.npy"
    assert write_keys(path, uids) == 3 and sorted(read_keys(path).to_pylist()) == sorted(uids)
    for key in ["0123456789ABCDEF0123456789ABCDEF", "0x" + "1" * 30, "+" + "1" * 31, "0000_" + "1" * 27,
                " " + "1" * 31, "1" * 31, "1" * 33, "g" * 32]:
        with pytest.raises(UserError, match="uid"):
            write_keys(path, [*uids, key])
    assert sorted(read_keys(path).to_pylist()) == sorted(uids)  # the refused exports left it as it was


def test_case_16_img2dataset_output_kept_under_data_is_read_as_img2dataset(tmp_path, capsys):
    root = tmp_path / "root"
    shutil.copytree(I2D_WDS, root / "data")
    scores = tmp_path / "s.parquet"
    code, out, err = run_cli(["score", root, "--out", scores, *TINY], capsys)
    assert code == 0, err
    assert "reading img2dataset webdataset output" in out and "sidecar" in out.split("detected:")[1]
    assert run_summary(scores)["pairs"] == 18
