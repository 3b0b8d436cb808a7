"""`pairclean query`: DuckDB over real scores (COCO shards, tiny model), every output format, the
truth views, the saved queries in docs/queries, and one-line errors."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import run_cli

from pairclean.errors import UserError
from pairclean.scorefile.db import ScoresDB

QUERIES = Path(__file__).parent.parent / "docs" / "queries"
SQL = "SELECT key, shard, \"index\", sim, osa_noisy FROM scores ORDER BY sim LIMIT 5"


def direct(scores: Path, sql: str) -> list[tuple]:
    con = duckdb.connect()
    con.execute(f"CREATE VIEW scores AS SELECT * FROM read_parquet('{scores}')")
    return con.execute(sql).fetchall()


def test_table_output(coco_scores, capsys):
    code, out, _ = run_cli(["query", str(coco_scores), SQL, "--limit", "3"], capsys)
    assert code == 0
    assert "osa_noisy" in out and "first 3 of 5 rows" in out
    worst_key = direct(coco_scores, SQL)[0][0]
    assert worst_key in out


def test_csv_json_parquet_equal_duckdb(tmp_path, coco_scores, capsys):
    expected = direct(coco_scores, SQL)

    code, out, _ = run_cli(["query", str(coco_scores), SQL, "--format", "csv"], capsys)
    rows = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and [r["key"] for r in rows] == [e[0] for e in expected]
    assert [float(r["sim"]) for r in rows] == pytest.approx([e[3] for e in expected], abs=1e-7)

    code, out, _ = run_cli(["query", str(coco_scores), SQL, "--format", "json"], capsys)
    lines = [json.loads(line) for line in out.splitlines()]
    assert [(r["key"], r["shard"], r["index"], r["osa_noisy"]) for r in lines] == [
        (e[0], e[1], e[2], e[4]) for e in expected]
    assert [r["sim"] for r in lines] == pytest.approx([e[3] for e in expected], abs=1e-7)

    target = tmp_path / "worst.parquet"
    code, _, _ = run_cli(["query", str(coco_scores), SQL, "--format", "parquet", "--out", str(target)], capsys)
    assert code == 0 and [tuple(r.values()) for r in pq.read_table(target).to_pylist()] == expected


@pytest.mark.parametrize("layout", ["shard-index", "moved-shards", "key"])
def test_truth_views_join_each_layout(tmp_path, coco_scores, truth, layout):
    t = pq.read_table(truth)
    if layout == "moved-shards":  # truth written for a copy of the shards: matched by file name
        t = t.set_column(1, "shard", pa.array(["/elsewhere/" + Path(s).name for s in t["shard"].to_pylist()]))
    if layout == "key":
        t = t.select(["key", "noisy"])
    path = tmp_path / "t.parquet"
    pq.write_table(t, path)
    with ScoresDB(coco_scores, truth=path) as db:
        assert db.truth_join == {"shard-index": "shard, index", "moved-shards": "shard file name, index",
                                 "key": "key"}[layout]
        rows = db.con.execute('SELECT "index", noisy FROM labeled').fetchall()
    assert len(rows) == 16 and all(noisy == (index % 3 == 0) for index, noisy in rows)


def test_truth_that_cannot_be_joined_is_a_user_error(tmp_path, coco_scores, truth):
    t = pq.read_table(truth)
    cases = {
        "no-noisy": t.drop(["noisy"]),
        "repeated": pa.concat_tables([t, t]),
        "no-match": t.set_column(0, "key", pa.array([f"x{i}" for i in range(len(t))])).select(["key", "noisy"]),
    }
    messages = {"no-noisy": "no 'noisy' column", "repeated": "repeated", "no-match": "matches no scored pair"}
    for name, table in cases.items():
        path = tmp_path / f"{name}.parquet"
        pq.write_table(table, path)
        with pytest.raises(UserError, match=messages[name]):
            ScoresDB(coco_scores, truth=path)


@pytest.mark.parametrize("query", sorted(p.name for p in QUERIES.glob("*.sql")))
def test_saved_queries_run(coco_scores, truth, capsys, query):
    code, out, err = run_cli(["query", str(coco_scores), "-f", str(QUERIES / query), "--truth", str(truth),
                              "--format", "json"], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert rows
    if query == "share-flagged-per-shard.sql":
        assert sum(r["pairs"] for r in rows) == 16 and len(rows) == 3
    if query == "similarity-histogram.sql":
        assert sum(r["pairs"] for r in rows) == 16
    if query == "truth-confusion.sql":
        flagged = direct(coco_scores, "SELECT count(*) FROM scores WHERE gmm_noisy")[0][0]
        assert {r["rule"]: r["flagged"] for r in rows}["GMM (p_clean < 0.5)"] == flagged


@pytest.mark.parametrize("argv, message", [
    (["SELECT p_clen FROM scores"], 'query failed: Binder Error: Referenced column "p_clen" not found'),
    (["SELECT 1; SELECT 2"], "give one SQL statement (got 2)"),
    (["SELECT 1", "--format", "csv", "--format", "xml"], "unknown format 'xml'"),
    (["SELECT 1", "--out", "x.csv"], "--out needs --format csv, json or parquet"),
    ([], "give the SQL as an argument or with --file"),
])
def test_errors_are_one_line_exit_2(coco_scores, capsys, argv, message):
    code, _, err = run_cli(["query", str(coco_scores), *argv], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


@pytest.fixture(scope="module")
def scores_with_recorded_truth(tmp_path_factory, coco_shards):
    """A copy `corrupt` wrote (its manifest names its truth), scored: the scores record the truth file."""
    from helpers import tiny_scores

    from pairclean.calibrate.corrupt import corrupt

    root = tmp_path_factory.mktemp("recorded")
    noisy = corrupt(str(coco_shards), root / "noisy", 0.3, seed=0, mode="shuffle")
    return tiny_scores(root / "noisy", root / "s.parquet"), noisy.truth


def test_the_truth_a_scores_file_recorded_is_attached(scores_with_recorded_truth, coco_scores, capsys):
    """As evaluate detection finds it. Before: "Table with name labeled does not exist!"."""
    scores, truth = scores_with_recorded_truth
    query = str(QUERIES / "truth-confusion.sql")
    code, recorded, err = run_cli(["query", scores, "-f", query, "--format", "csv"], capsys)
    assert code == 0, err
    code, given, err = run_cli(["query", scores, "-f", query, "--format", "csv", "--truth", truth], capsys)
    assert code == 0 and recorded == given and "GMM (p_clean < 0.5)" in recorded
    code, out, err = run_cli(["query", scores, "--columns"], capsys)
    assert code == 0 and "labeled" in out
    code, _, err = run_cli(["query", coco_scores, "-f", query], capsys)  # recorded no truth: say how to give one
    assert code == 2 and err.strip().endswith(f"the views truth and labeled need --truth FILE ({coco_scores} records "
                                              "no truth file)"), err


def test_not_a_scores_file(coco_parquet, tmp_path, capsys):
    code, _, err = run_cli(["query", str(coco_parquet), "SELECT 1"], capsys)
    assert code == 2 and "is not a pairclean scores file" in err
    code, _, err = run_cli(["query", str(tmp_path / "missing.parquet"), "SELECT 1"], capsys)
    assert code == 2 and "scores file not found" in err


def test_the_readme_queries_with_what_the_main_install_brings(tmp_path, coco_scores, capsys, monkeypatch):
    """README's query line runs after `pip install -e .` alone: no `duckdb` shell (that is duckdb-cli,
    outside the main dependencies), and it counts what DuckDB counts."""
    import shlex

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    commands = [line.strip() for line in readme.splitlines() if line.startswith("    ")]
    assert not [c for c in commands if c.startswith("duckdb ")]
    query = next(c for c in commands if c.startswith("pairclean query scores.parquet "))
    (tmp_path / "scores.parquet").write_bytes(coco_scores.read_bytes())
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(shlex.split(query)[1:] + ["--format", "csv"], capsys)
    expected = direct(coco_scores, query.split('"')[1])[0][0]  # what DuckDB itself counts
    assert code == 0 and out.splitlines()[1:] == [str(expected)], err
