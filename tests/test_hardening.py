"""Hardening (issue #15): the user's own SQL, outputs, numbers and inputs as the hazard.

Each test drives a real component (real scores Parquet, real DuckDB, real tar shards, the CLI
entry point) with an input a careless or hostile user could give, and checks that it is refused
with one line (exit 2) and that nothing already written is lost or leaked.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pairclean.cli import main
from pairclean.curate.query import ScoresDB
from pairclean.data.manifest import open_dataset
from pairclean.errors import UserError
from pairclean.train.data import index_shards
from pairclean.train.weights import build_weight_arrays

SECRET = "TOP-SECRET-HOST-CONTENT"


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = 0
    try:
        main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


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
    with pytest.raises(UserError, match="bad --filter predicate.*give one boolean SQL expression"):
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


def snapshot(*paths: Path) -> dict[str, bytes]:
    """Every file under `paths` with its bytes: what must survive a refused command."""
    files = {}
    for root in paths:
        for f in ([root] if root.is_file() else sorted(root.rglob("*"))):
            if f.is_file():
                files[str(f)] = f.read_bytes()
    return files


@pytest.fixture
def shards(tmp_path, coco_shards) -> Path:
    """A private copy of the COCO shards: a command that wrongly deletes its input harms only this."""
    import shutil

    return Path(shutil.copytree(coco_shards, tmp_path / "data" / "shards"))


@pytest.fixture
def scores_copy(tmp_path, coco_scores) -> Path:
    import shutil

    return Path(shutil.copy(coco_scores, tmp_path / "scores.parquet"))


def refused(argv, capsys, *keep: Path, message: str = "") -> None:
    before = snapshot(*keep)
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert snapshot(*keep) == before


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
    for prefix in ["../escaped", "/tmp/escaped", "..", ""]:
        refused(["filter", shards, "--scores", scores_copy, "--where", "true", "--out", tmp_path / "out",
                 "--prefix", prefix], capsys, shards, message="plain file-name prefix")
    assert not list(tmp_path.glob("escaped*")) and not (tmp_path / "out").exists()


def test_filter_out_inside_the_input_directory_is_refused(shards, scores_copy, capsys):
    refused(["filter", shards, "--scores", scores_copy, "--where", "true", "--out", shards / "clean"], capsys,
            shards, message="inside the input directory")
    assert not (shards / "clean").exists()


# -- 4. Numbers are checked at the edge ----------------------------------------------------------

@pytest.mark.parametrize("args, field", [
    (["--seed", "-1"], "--seed"), (["--workers", "-1"], "--workers"), (["--beta-k", "0"], "--beta-k"),
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
    from pairclean.train.trainer import TrainConfig, train

    cfg = TrainConfig(model="pairclean-tiny", pretrained="none", epochs=2, batch_size=8, lr=1e30, warmup_steps=0,
                      workers=0, shuffle_buffer=8, log_every=1)
    with pytest.raises(UserError, match="training loss became"):
        train(str(coco_shards), tmp_path / "run", cfg)
    assert not list((tmp_path / "run").rglob("*.pt"))
