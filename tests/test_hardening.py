"""Hardening (issue #15): the user's own SQL, outputs, numbers and inputs as the hazard.

Each test drives a real component (real scores Parquet, real DuckDB, real tar shards, the CLI
entry point) with an input a careless or hostile user could give, and checks that it is refused
with one line (exit 2) and that nothing already written is lost or leaked.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import killed_after_first_unit, refused, run_cli, tiny_scores
from pairclean.scorefile.db import ScoresDB
from pairclean.data.dataset import open_dataset
from pairclean.errors import UserError
from pairclean.training.data import index_shards
from pairclean.training.weights import build_weight_arrays

SECRET = "TOP-SECRET-HOST-CONTENT"


@pytest.fixture
def host_file(tmp_path) -> Path:
    path = tmp_path / "host.txt"
    path.write_text(SECRET)
    return path


# -- 1. SQL reaches only one expression over the scores ------------------------------------------

def test_train_filter_cannot_run_a_second_statement(tmp_path, coco_shards, coco_scores):
    leak = tmp_path / "leak.csv"
    spec = open_dataset(str(coco_shards))
    predicate = f"true) FROM scores; COPY (SELECT 1) TO '{leak}'; SELECT (true"
    (tmp_path / "run").mkdir()
    with pytest.raises(UserError, match="bad `filter` predicate.*give one boolean SQL expression"):
        build_weight_arrays(coco_scores, spec, index_shards(spec), tmp_path / "run", predicate=predicate)
    assert not leak.exists()


@pytest.mark.parametrize("command", ["filter", "train"])
def test_predicates_cannot_read_host_files_or_echo_them(tmp_path, coco_shards, coco_scores, host_file, capsys,
                                                        command):
    for predicate in [f"(SELECT content FROM read_text('{host_file}'))::INTEGER > 0",
                      f"(SELECT count(*) FROM glob('{host_file.parent}/*')) > 0",
                      "(SELECT count(*) FROM read_parquet('https://127.0.0.1:9/x.parquet')) > 0"]:
        if command == "filter":
            argv = ["filter", coco_shards, "--scores", coco_scores, "--where", predicate, "--out", tmp_path / "out"]
        else:
            argv = ["train", coco_shards, "--out", tmp_path / "run", "--model", "pairclean-tiny", "--pretrained",
                    "none", "--workers", "0", "--method", "osa-weights", "--scores", coco_scores, "--filter", predicate]
        code, out, err = run_cli(argv, capsys)
        assert code == 2, err
        assert len(err.strip().splitlines()) == 1 and "Permission Error" in err, err
        assert SECRET not in out + err and "httpfs" not in err
    assert {p.name for p in tmp_path.iterdir()} <= {"host.txt", "run"}  # no filtered output, no leak


def test_every_scores_connection_is_sandboxed(coco_scores, tmp_path):
    with ScoresDB(coco_scores) as db:
        settings = dict(db.con.execute(
            "SELECT name, value FROM duckdb_settings() WHERE name IN ('enable_external_access', "
            "'autoinstall_known_extensions', 'autoload_known_extensions', 'lock_configuration')").fetchall())
        assert settings == {"enable_external_access": "false", "autoinstall_known_extensions": "false",
                            "autoload_known_extensions": "false", "lock_configuration": "true"}
        with pytest.raises(Exception, match="locked"):
            db.con.execute("SET enable_external_access = true")
        assert db.scalar("SELECT count(*) FROM scores") == 16  # its own file stays readable


@pytest.mark.parametrize("sql", ["COPY scores TO '{dir}/copy.csv'", "ATTACH '{dir}/attached.duckdb' AS x",
                                 "INSTALL httpfs", "CREATE TABLE t AS SELECT 1",
                                 "SELECT * FROM read_text('{host}')"])
def test_query_is_read_only(tmp_path, coco_scores, host_file, capsys, sql):
    code, out, err = run_cli(["query", coco_scores, sql.format(dir=tmp_path, host=host_file)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "read-only" in err or "Permission Error" in err, err
    assert SECRET not in out + err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["host.txt"]


# -- 2. Outputs never destroy or re-read inputs --------------------------------------------------

TINY = ["--model", "pairclean-tiny", "--pretrained", "none", "--beta-k", "64", "--workers", "0"]


@pytest.fixture
def shards(tmp_path, coco_shards) -> Path:
    """A private copy of the COCO shards: a command that wrongly deletes its input harms only this."""
    import shutil

    return Path(shutil.copytree(coco_shards, tmp_path / "data" / "shards"))


@pytest.fixture
def scores_copy(tmp_path, coco_scores) -> Path:
    import shutil

    return Path(shutil.copy(coco_scores, tmp_path / "scores.parquet"))


def test_query_and_report_cannot_replace_the_scores_they_read(scores_copy, capsys):
    refused(["query", scores_copy, "SELECT * FROM scores", "--format", "parquet", "--out", scores_copy], capsys,
            scores_copy, message="is an input")
    refused(["report", scores_copy, "--out", scores_copy], capsys, scores_copy, message="is an input")
    link = scores_copy.parent / "link.parquet"
    link.symlink_to(scores_copy)
    refused(["query", scores_copy, "SELECT 1", "--format", "csv", "--out", link], capsys, scores_copy,
            message="is an input")


def test_overwrite_never_deletes_an_input(tmp_path, shards, scores_copy, capsys):
    data = shards.parent
    for out in [shards, data, tmp_path, shards / ".." / "shards"]:
        refused(["filter", shards, "--scores", scores_copy, "--where", "true", "--out", out, "--overwrite"], capsys,
                shards, scores_copy)
        refused(["corrupt", shards, "--ratio", "0.5", "--out", out, "--overwrite"], capsys, shards)
        refused(["train", shards, *TINY[:4], "--workers", "0", "--out", out, "--overwrite"], capsys, shards)
    refused(["score", shards, *TINY, "--out", sorted(shards.glob("*.tar"))[0], "--overwrite"], capsys, shards)
    refused(["score", sorted(shards.glob("*.tar"))[0], *TINY, "--out", sorted(shards.glob("*.tar"))[0],
             "--overwrite"], capsys, shards, message="is an input")
    refused(["filter", shards, "--scores", scores_copy, "--where", "true", "--out", scores_copy, "--overwrite"],
            capsys, scores_copy, message="is an input")


def test_parquet_input_cannot_be_scored_onto_itself(tmp_path, coco_parquet, capsys):
    import shutil

    pairs = Path(shutil.copy(coco_parquet, tmp_path / "pairs.parquet"))
    refused(["score", pairs, *TINY, "--out", pairs, "--overwrite"], capsys, pairs, message="is an input")
    refused(["score", tmp_path, *TINY, "--out", tmp_path / "scores.parquet"], capsys, pairs,
            message="inside the input directory")
    assert not (tmp_path / "scores.parquet").exists()


def test_filter_prefix_cannot_escape_out(tmp_path, shards, scores_copy, capsys):
    for prefix in ["../escaped", "/tmp/escaped", ".."]:  # '' names outputs like the input's (issue 24)
        refused(["filter", shards, "--scores", scores_copy, "--where", "true", "--out", tmp_path / "out",
                 "--prefix", prefix], capsys, shards, message="plain file-name prefix")
    assert not list(tmp_path.glob("escaped*")) and not (tmp_path / "out").exists()


def test_filter_out_inside_the_input_directory_is_refused(shards, scores_copy, capsys):
    refused(["filter", shards, "--scores", scores_copy, "--where", "true", "--out", shards / "clean"], capsys,
            shards, message="inside the input directory")
    assert not (shards / "clean").exists()


# -- 4. Numbers are checked at the edge ----------------------------------------------------------

@pytest.mark.parametrize("args, field", [
    (["--seed", "-1"], "--seed"), (["--workers", "-1"], "--workers"), (["--workers", "two"], "--workers"),
    (["--workers", "1.5"], "--workers"), (["--beta-k", "0"], "--beta-k"),
    (["--gmm-sample", "0"], "--gmm-sample"), (["--beta-mode", "fixed", "--beta", "nan"], "--beta"),
    (["--beta-mode", "fixed", "--beta", "inf"], "--beta"), (["--pretrained", ""], "--pretrained"),
])
def test_score_numbers_are_refused_with_one_line(tmp_path, shards, capsys, args, field):
    out = tmp_path / "scores.parquet"
    refused(["score", shards, *TINY, *args, "--out", out], capsys, shards, message=field)
    assert not out.exists()


@pytest.mark.parametrize("args, field", [
    (["--lr", "nan"], "--lr"), (["--seed", "-1"], "--seed"), (["--pretrained", ""], "--pretrained"),
    (["--workers", "-1"], "--workers"),
])
def test_train_numbers_are_refused_with_one_line(tmp_path, shards, capsys, args, field):
    argv = ["train", shards, "--model", "pairclean-tiny", "--pretrained", "none", "--workers", "0", *args,
            "--out", tmp_path / "run"]
    refused(argv, capsys, shards, message=field)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_curate_numbers_are_refused_with_one_line(tmp_path, shards, scores_copy, capsys):
    refused(["report", scores_copy, "--out", tmp_path / "r.html", "--bins", "100000000"], capsys, scores_copy,
            message="--bins")
    refused(["query", scores_copy, "SELECT 1", "--limit", "-1"], capsys, scores_copy, message="--limit")
    refused(["filter", shards, "--scores", scores_copy, "--where", "true", "--out", tmp_path / "f",
             "--shard-bytes", "0"], capsys, shards, message="--shard-bytes")
    refused(["corrupt", shards, "--ratio", "0.5", "--seed", "-1", "--out", tmp_path / "c"], capsys, shards,
            message="--seed")
    assert not {"r.html", "f", "c"} & {p.name for p in tmp_path.iterdir()}


def weights_file(tmp_path: Path, scores: Path, sql: str) -> Path:
    import duckdb

    out = tmp_path / "weights.parquet"
    duckdb.execute(f"COPY (SELECT * REPLACE ({sql}) FROM '{scores}') TO '{out}' (FORMAT parquet)")
    return out


@pytest.mark.parametrize("sql, message", [
    ("CASE WHEN \"index\" = 0 AND shard LIKE '%000000.tar' THEN 'inf'::DOUBLE ELSE weight_norm END AS weight_norm",
     "NaN or infinite"),
    ("CASE WHEN \"index\" = 1 THEN 'nan'::DOUBLE ELSE weight_norm END AS weight_norm", "NaN or infinite"),
    ("weight_norm::VARCHAR AS weight_norm", "not numeric"),
])
@pytest.mark.parametrize("on_missing", ["error", "keep"])
def test_bad_weights_are_refused_not_trained(tmp_path, coco_shards, coco_scores, sql, message, on_missing):
    scores = weights_file(tmp_path, coco_scores, sql)
    spec = open_dataset(str(coco_shards))
    (tmp_path / "run").mkdir()
    with pytest.raises(UserError, match=message):
        build_weight_arrays(scores, spec, index_shards(spec), tmp_path / "run", on_missing=on_missing)
    assert not (tmp_path / "run" / "weights").exists()


def test_a_loss_that_turns_non_finite_stops_training_without_a_checkpoint(tmp_path, coco_shards, one_torch_thread):
    from pairclean.training.trainer import TrainConfig, train

    cfg = TrainConfig(model="pairclean-tiny", pretrained="none", epochs=2, batch_size=8, lr=1e30, warmup_steps=0,
                      workers=0, shuffle_buffer=8, log_every=1)
    with pytest.raises(UserError, match="training loss became"):
        train(str(coco_shards), tmp_path / "run", cfg)
    assert not list((tmp_path / "run").rglob("*.pt"))


# -- 5. Inputs that crashed or hung --------------------------------------------------------------

def parquet_pairs(path: Path, captions, image: bytes) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"key": [f"k{i}" for i in range(len(captions))], "caption": captions,
                             "image": [image] * len(captions)}), path)
    return path


def jpeg(size=(32, 16), orientation: int | None = None) -> bytes:
    import io

    from PIL import Image

    img = Image.new("RGB", size, (200, 30, 30))
    exif = Image.Exif()
    if orientation:
        exif[0x0112] = orientation
    buf = io.BytesIO()
    img.save(buf, "JPEG", exif=exif)
    return buf.getvalue()


@pytest.mark.parametrize("captions", [[1, 2], [[1], [2]], [{"a": 1}, {"a": 2}]])
def test_non_text_caption_columns_become_error_rows(tmp_path, captions):
    dataset = open_dataset(str(parquet_pairs(tmp_path / "p.parquet", captions, jpeg())))
    rows = [p for u in dataset.units() for p in dataset.read(u)]
    assert len(rows) == 2 and all(r.error and "not text" in r.error for r in rows)


def test_zero_row_group_parquet_is_zero_pairs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "empty.parquet"
    pq.ParquetWriter(path, pa.schema([("key", pa.string()), ("caption", pa.string()), ("image", pa.binary())])).close()
    assert pq.ParquetFile(path).metadata.num_row_groups == 0
    assert open_dataset(str(path)).units() == []


def test_image_paths_to_fifos_and_huge_files_are_refused_without_reading(tmp_path, monkeypatch):
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    from pairclean.data.dataset import Dataset
    from pairclean.data.reading import values
    from pairclean.data.spec import DatasetSpec, Fields

    os.mkfifo(tmp_path / "pipe.jpg")
    (tmp_path / "big.jpg").write_bytes(b"\xff" * 2048)
    (tmp_path / "ok.jpg").write_bytes(jpeg())
    monkeypatch.setattr(values, "MAX_MEMBER_BYTES", 1024)
    pq.write_table(pa.table({"key": ["a", "b", "c"], "caption": ["x", "y", "z"],
                             "path": ["pipe.jpg", "big.jpg", "ok.jpg"]}), tmp_path / "p.parquet")
    dataset = Dataset(DatasetSpec(format="parquet", shards=[str(tmp_path / "p.parquet")],
                                  fields=Fields(image_path="path", text="caption", key="key")))
    rows = [p for u in dataset.units() for p in dataset.read(u)]  # a FIFO would hang here
    assert "not a regular file" in rows[0].error
    assert "over the 1,024-byte limit" in rows[1].error
    assert rows[2].error is None


def test_exif_orientation_is_applied():
    from pairclean.data.decode import decode_image

    assert decode_image(jpeg((32, 16))).size == (32, 16)
    assert decode_image(jpeg((32, 16), orientation=6)).size == (16, 32)  # "rotate 90 CW" tag


def test_markup_in_user_text_is_printed_not_parsed(tmp_path, capsys):
    code, _, err = run_cli(["query", tmp_path / "[/red]x[bold].parquet", "SELECT 1"], capsys)
    assert code == 2 and "[/red]x[bold].parquet" in err and len(err.strip().splitlines()) == 1, err


def test_dollar_signs_in_shard_names_do_not_break_the_report(tmp_path, coco_shards):
    import shutil

    from pairclean.curate.report import build_report

    data = tmp_path / "data"
    data.mkdir()
    for i, shard in enumerate(sorted(coco_shards.glob("*.tar"))):
        shutil.copy(shard, data / f"$x^^{i}$_.tar")  # not valid mathtext: typesetting it raised
    scores = tiny_scores(data, tmp_path / "scores.parquet")
    result = build_report(scores, tmp_path / "report.html")
    assert result.pairs == 16 and "$x^^0$" in (tmp_path / "report.html").read_text()


def test_a_process_refused_at_begin_leaves_the_winners_run_alone(tmp_path, monkeypatch):
    """Two processes enter `begin` at once: the loser saw no parts directory, the winner then
    created and locked it. The loser's clean-up must not delete the winner's parts."""
    import subprocess
    import sys

    from pairclean.runs import PartStore, parts_dir_for

    out = tmp_path / "scores.parquet"
    winner = subprocess.Popen([sys.executable, "-c", (
        "import sys, pathlib; from pairclean.runs import PartStore, parts_dir_for\n"
        f"store = PartStore(parts_dir_for(pathlib.Path({str(out)!r})))\n"
        "store.begin(pathlib.Path(" + repr(str(out)) + "), {'a': 1}, ['u'])\n"
        "print('ready', flush=True); sys.stdin.read()")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert winner.stdout.readline().strip() == "ready"
        parts = parts_dir_for(out)
        real_is_dir = Path.is_dir
        seen = []

        def late_is_dir(self):  # the loser looked before the winner's mkdir
            if self == parts and not seen:
                seen.append(self)
                return False
            return real_is_dir(self)

        monkeypatch.setattr(Path, "is_dir", late_is_dir)
        with pytest.raises(UserError, match="another pairclean process"):
            PartStore(parts).begin(out, {"a": 1}, ["u"])
        monkeypatch.undo()
        assert (parts / "settings.json").is_file() and (parts / "units.json").is_file()
    finally:
        winner.communicate("")


# -- 3. Resume trusts contents, not names --------------------------------------------------------

def test_one_shard_under_three_spellings_is_one_unit(tmp_path, shards, fast_config):
    from pairclean.scoring.model import score

    first = sorted(shards.glob("*.tar"))[0]
    link = tmp_path / "link.tar"
    link.symlink_to(first)
    spelled = [str(first), str(shards / ".." / "shards" / first.name), str(link)]
    spec = open_dataset(spelled)
    assert spec.units() == [str(first)]
    result = score(spec, tmp_path / "scores.parquet", fast_config)
    assert result.summary.pairs == 6


def test_a_shard_changed_after_its_unit_was_committed_is_refused_on_resume(tmp_path, shards, fast_config):
    import os

    from pairclean.scoring.model import score

    out = tmp_path / "scores.parquet"
    killed_after_first_unit(lambda: score(str(shards), out, fast_config))
    first = sorted(shards.glob("*.tar"))[0]
    os.utime(first, ns=(first.stat().st_atime_ns, first.stat().st_mtime_ns + 10**9))  # rewritten in place
    with pytest.raises(UserError, match="changed since the unfinished run scored it"):
        score(str(shards), out, fast_config)
    assert not out.exists()


def test_a_checkpoint_replaced_between_kill_and_resume_is_refused(tmp_path, shards, fast_config):
    import dataclasses

    import open_clip
    import torch

    from pairclean.scoring.model import score

    checkpoint = tmp_path / "model.pt"
    torch.manual_seed(0)
    torch.save(open_clip.create_model("pairclean-tiny").state_dict(), checkpoint)
    cfg = dataclasses.replace(fast_config, pretrained=str(checkpoint))
    out = tmp_path / "scores.parquet"
    killed_after_first_unit(lambda: score(str(shards), out, cfg))
    torch.manual_seed(1)
    torch.save(open_clip.create_model("pairclean-tiny").state_dict(), checkpoint)  # same path, other model
    with pytest.raises(UserError, match="weights_sha256"):
        score(str(shards), out, cfg)
    assert not out.exists()


# -- 6. First use --------------------------------------------------------------------------------

def test_a_run_where_every_unit_failed_says_why_on_stderr(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "pairs.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "sentence": ["x", "y"]}), data)  # not the expected columns
    code, _, err = run_cli(["score", data, *TINY, "--out", tmp_path / "scores.parquet"], capsys)
    # named before any model is built since issue 56 (its columns and the flags to name them)
    assert code == 2 and "error: pairs.parquet has no column 'image'" in err and "--text-field" in err, err
    data.write_bytes(data.read_bytes()[:-20])  # no footer: every unit fails when it is read
    code, _, err = run_cli(["score", data, *TINY, "--out", tmp_path / "scores.parquet"], capsys)
    assert code == 2 and "error: every input unit failed" in err and "pairs.parquet" in err, err


def test_text_only_backend_on_image_pairs_names_the_pair_option(tmp_path, shards, capsys):
    code, _, err = run_cli(["score", shards, "--backend", "sentence-transformers", "--model",
                            "sentence-transformers/all-MiniLM-L6-v2", "--out", tmp_path / "s.parquet"], capsys)
    assert code == 2 and "set --pair to text-text" in err, err


def test_a_directory_holding_a_manifest_is_read_as_that_manifest(tmp_path, shards):
    import yaml

    manifest = yaml.safe_load((shards / "manifest.yaml").read_text())
    manifest["shards"] = manifest["shards"][:1]
    manifest["pair"] = "image-label"
    (shards / "manifest.yaml").write_text(yaml.safe_dump(manifest))
    spec = open_dataset(str(shards)).spec
    assert len(spec.shards) == 1 and spec.pair == "image-label"


def test_readme_calibrate_recipe_names_the_file_corrupt_writes():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert "--truth noisy/truth/truth.parquet" in readme and "--truth noisy/truth.parquet" not in readme


def test_evaluate_detection_joins_on_a_named_truth_key_column(tmp_path, coco_scores, capsys):
    import duckdb

    truth = tmp_path / "truth.parquet"
    duckdb.execute(f"COPY (SELECT key AS pair_id, \"index\" % 4 = 0 AS noisy FROM '{coco_scores}') "
                   f"TO '{truth}' (FORMAT parquet)")
    code, _, err = run_cli(["evaluate", "detection", coco_scores, "--truth", truth, "--json", tmp_path / "d.json"],
                           capsys)
    assert code == 2 and "needs columns shard and index, or key" in err
    code, out, err = run_cli(["evaluate", "detection", coco_scores, "--truth", truth, "--truth-key", "pair_id",
                              "--json", tmp_path / "d.json"], capsys)
    assert code == 0, err
    import json

    assert json.loads((tmp_path / "d.json").read_text())["noisy"] == 5  # index 0 and 4 of the 6-6-4 shards


def test_corrupt_on_text_text_parquet_without_pair_says_what_to_pass(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.table({"key": ["a", "b"], "caption": ["one dog", "two cats"],
                             "caption2": ["a dog", "some cats"]}), data / "text.parquet")
    code, _, err = run_cli(["corrupt", data / "text.parquet", "--ratio", "0.5", "--out", tmp_path / "noisy"], capsys)
    assert code == 2 and "--pair text-text" in err, err
    assert not (tmp_path / "noisy").exists()
