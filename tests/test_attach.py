"""`--attach NAME=FILE` with `pairclean dedup`'s output: a Parquet file joined with the scores in one
predicate (filter, query, train --filter), inside the same sandbox: the attached file is readable,
nothing else is. (tests/test_ecosystem.py covers attaching img2dataset's metadata and key lists.)"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import run_cli

from pairclean.errors import ConfigError, UserError
from pairclean.config import parse_attachments
from pairclean.scorefile.db import ScoresDB, check_attach_name, compile_predicate

KEPT = '(shard, "index") IN (SELECT shard, "index" FROM dedup WHERE kept)'


@pytest.fixture(scope="module")
def dedup_file(tmp_path_factory, coco_scores):
    """A dedup-like table over the scored pairs: every third pair not kept."""
    rows = pq.read_table(coco_scores, columns=["key", "shard", "index"]).to_pylist()
    table = pa.table({"key": [r["key"] for r in rows], "shard": [r["shard"] for r in rows],
                      "index": [r["index"] for r in rows], "kept": [i % 3 != 0 for i in range(len(rows))]})
    path = tmp_path_factory.mktemp("attach") / "dedup.parquet"
    pq.write_table(table, path)
    return path


def test_a_predicate_joins_the_attached_table(coco_scores, dedup_file):
    with ScoresDB(coco_scores, attach={"dedup": [str(dedup_file)]}) as db:
        sql = compile_predicate(db, f"sim > -1 AND {KEPT}", "where")
        kept = db.scalar(f"SELECT count(*) FROM scores WHERE {sql}")
        total = db.scalar("SELECT count(*) FROM scores")
    assert kept == total - len(range(0, total, 3)) and kept > 0


def test_attach_opens_no_other_file(coco_scores, dedup_file, tmp_path):
    other = tmp_path / "secret.parquet"
    pq.write_table(pa.table({"x": [1]}), other)
    with ScoresDB(coco_scores, attach={"dedup": [str(dedup_file)]}) as db:
        with pytest.raises(ConfigError, match="where"):
            compile_predicate(db, f"key IN (SELECT CAST(x AS VARCHAR) FROM read_parquet('{other}'))", "where")


@pytest.mark.parametrize("specs, message", [
    (["dedup"], "NAME=FILE"), (["=a.parquet"], "NAME=FILE"), (["1x=a.parquet"], "plain identifier"),
    (["scores=a.parquet"], "not one of"), (["d=a.parquet", "D=b.parquet"], "attached twice"),
])
def test_bad_attach_specs_are_refused(specs, message):
    with pytest.raises(ConfigError, match=message) as caught:
        parse_attachments(specs, check_name=check_attach_name)
    assert caught.value.fields == ("attach",)


def test_missing_or_unreadable_attached_file(coco_scores, tmp_path):
    with pytest.raises(UserError, match="file not found"):
        ScoresDB(coco_scores, attach={"d": [str(tmp_path / "nope.parquet")]})
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(UserError, match="cannot read attached table d"):
        ScoresDB(coco_scores, attach={"d": [str(bad)]})


def test_filter_and_query_take_attach(coco_scores, coco_shards, dedup_file, capsys):
    code, out, _ = run_cli(["filter", coco_shards, "--scores", coco_scores, "--attach", f"dedup={dedup_file}",
                            "--where", KEPT, "--dry-run"], capsys)
    assert code == 0, out
    kept = sum(pq.read_table(dedup_file).column("kept").to_pylist())
    assert f"{kept:,}" in out
    code, out, _ = run_cli(["query", coco_scores, "--attach", f"dedup={dedup_file}", "--format", "csv",
                            "SELECT count(*) AS n FROM scores JOIN dedup USING (shard, \"index\") WHERE kept"], capsys)
    assert code == 0 and out.split()[-1] == str(kept)
    code, _, err = run_cli(["query", coco_scores, "--attach", "dedup", "SELECT 1"], capsys)
    assert code == 2 and "--attach" in err and "Traceback" not in err


def test_train_filter_reads_the_attached_table(tmp_path, coco_scores, coco_shards, dedup_file):
    from pairclean.data.dataset import open_dataset
    from pairclean.training.data import index_shards
    from pairclean.training.methods.filter import FilterOptions
    from pairclean.training.weights import build_weight_arrays

    options = FilterOptions(scores=str(coco_scores), filter=KEPT, attach=f"dedup={dedup_file}")
    spec = open_dataset(str(coco_shards))
    (tmp_path / "run").mkdir()
    join = build_weight_arrays(coco_scores, spec, index_shards(spec), tmp_path / "run", column=None,
                               predicate=options.filter, attach=options.attachments())
    assert join.kept == sum(pq.read_table(dedup_file).column("kept").to_pylist()) and join.dropped > 0
    with pytest.raises(ConfigError, match="NAME=FILE"):
        FilterOptions(scores=str(coco_scores), filter=KEPT, attach="dedup")
