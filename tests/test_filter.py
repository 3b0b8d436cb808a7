"""`pairclean filter` on real COCO shards and Parquet scored by the tiny model: the kept set is
exactly DuckDB's answer, members come out byte-identical, bad input leaves nothing behind."""

from __future__ import annotations

import gzip
import io
import shutil
import tarfile
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from helpers import run_cli, tiny_scores

from pairclean.cli import main
from pairclean.errors import UserError
from pairclean.curate.filter import filter_dataset
from pairclean.data.dataset import open_dataset
from pairclean.data.manifest import load_manifest

# the issue's was "p_clean >= 0.5 AND weight > 0"; on coco_scores (a random model's) the GMM abstains
# (issue 55: p_clean is NULL), so the beta rule's verdict stands in for it
ISSUE_PREDICATE = "NOT osa_noisy AND weight > 0"


def duckdb_rows(scores: Path, sql_tail: str) -> list[tuple]:
    return duckdb.sql(f"SELECT shard, \"index\", key FROM read_parquet('{scores}') {sql_tail}").fetchall()


def tar_members(path: Path) -> list[tuple[str, bytes]]:
    """(member name, bytes) in file order, straight from tarfile: the ground truth for byte identity."""
    with tarfile.open(path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers() if m.isreg()]


def source_samples(shards: list[str]) -> dict[tuple[str, int], list[tuple[str, bytes]]]:
    """(shard, index) -> that sample's members, grouped by key prefix in file order."""
    out = {}
    for shard in shards:
        index, last = -1, None
        for name, data in tar_members(Path(shard)):
            prefix = name.split(".", 1)[0]
            if prefix != last:
                index, last = index + 1, prefix
            out.setdefault((shard, index), []).append((name, data))
    return out


def test_filter_keeps_exactly_the_duckdb_result_byte_identical(tmp_path, coco_shards, coco_scores, capsys):
    expected = duckdb_rows(coco_scores, f"WHERE {ISSUE_PREDICATE} ORDER BY shard, \"index\"")
    assert 0 < len(expected) < 16  # the rule keeps some, not all
    out = tmp_path / "clean"
    main(["filter", str(coco_shards / "manifest.yaml"), "--scores", str(coco_scores), "--where", ISSUE_PREDICATE,
            "--out", str(out), "--shard-size", "2"])
    assert f"wrote {len(expected)} pairs" in capsys.readouterr().out

    manifest = load_manifest(out / "manifest.yaml")
    assert manifest.format == "webdataset" and manifest.name == "coco-mini-filtered"
    assert len(manifest.shards) == -(-len(expected) // 2)  # at most 2 samples per output shard

    # Read back with webdataset itself: the keys are the query's, in the same order.
    read_back = list(wds.WebDataset(manifest.shards, shardshuffle=False, empty_check=False))
    assert [s["__key__"] for s in read_back] == [k for _, _, k in expected]

    # Every member of every kept sample, byte for byte, under its original name.
    source = source_samples(open_dataset(str(coco_shards)).spec.shards)
    written = [m for shard in manifest.shards for m in tar_members(Path(shard))]
    assert written == [m for shard, index, _ in expected for m in source[(shard, index)]]
    assert {name.split(".", 1)[1] for name, _ in written} == {"jpg", "txt"}


def test_written_shards_carry_one_header_a_member(tmp_path, coco_shards, coco_scores):
    """webdataset 1.0's TarWriter writes PAX tars (its `format` is not passed on), where a fractional
    mtime costs each member a PAX header block: pairclean's shards stamp whole seconds, so a member's
    data follows its one 512-byte header (1 kB less a member, half the headers for readers to parse)."""
    out = tmp_path / "clean"
    filter_dataset(open_dataset(str(coco_shards)), coco_scores, out, where=["sim > -1"])
    members = [m for shard in sorted(out.glob("*.tar")) for m in tarfile.open(shard).getmembers()]
    assert len(members) == 2 * 16
    assert all(m.offset_data - m.offset == tarfile.BLOCKSIZE and not m.pax_headers for m in members)


def test_top_fraction_is_the_top_of_duckdbs_ranking(tmp_path, coco_shards, coco_scores):
    expected = duckdb_rows(coco_scores, "ORDER BY sim DESC, shard, \"index\" LIMIT 8")
    result = filter_dataset(open_dataset(str(coco_shards)), coco_scores, tmp_path / "top", top_fraction=0.5)
    assert result.kept_pairs == 8
    keys = [s["__key__"] for s in wds.WebDataset(result.output_files, shardshuffle=False, empty_check=False)]
    assert sorted(keys) == sorted(k for _, _, k in expected)


def test_dry_run_counts_each_rule_and_writes_nothing(tmp_path, coco_shards, coco_scores, capsys):
    rules = [ISSUE_PREDICATE, "NOT osa_noisy"]
    out = tmp_path / "never"
    main(["filter", str(coco_shards), "--scores", str(coco_scores), "--where", rules[0], "--where", rules[1],
            "--top-fraction", "0.75", "--out", str(out), "--dry-run"])
    printed = capsys.readouterr().out
    assert not list(tmp_path.iterdir())

    dry = filter_dataset(open_dataset(str(coco_shards)), coco_scores, out, where=rules, top_fraction=0.75,
                         dry_run=True)
    assert [c.rule for c in dry.counts] == rules + ["top 0.75 by sim", "all rules"]
    for c in dry.counts[:2]:
        assert c.pairs == len(duckdb_rows(coco_scores, f"WHERE {c.rule}"))
        assert f"{c.pairs:,}" in printed
    assert dry.counts[2].pairs == 12
    assert dry.total_pairs == 16 and not dry.bytes_estimated

    # The bytes the dry run promises are the member bytes the real run writes.
    real = filter_dataset(open_dataset(str(coco_shards)), coco_scores, out, where=rules, top_fraction=0.75)
    assert real.kept_pairs == dry.counts[-1].pairs
    member_bytes = sum(len(data) for shard in real.output_files for _, data in tar_members(Path(shard)))
    assert dry.kept_bytes == dry.counts[-1].bytes == real.kept_bytes == member_bytes
    all_bytes = sum(len(d) for shard in open_dataset(str(coco_shards)).spec.shards for _, d in tar_members(Path(shard)))
    assert dry.total_bytes == all_bytes


@pytest.mark.parametrize("predicate, duckdb_says", [
    ("p_clen >= 0.5", 'Binder Error: Referenced column "p_clen" not found'),
    ("p_clean >= ", "Parser Error: syntax error"),
    ("('x' || key)::INTEGER > 0", "Conversion Error"),
    ("sim + 1", "it is FLOAT, not BOOLEAN"),
    ("true) AS keep FROM scores; DROP VIEW scores; SELECT (true", "give one boolean SQL expression"),
    ("sim > 0) AS keep, (sim > 1", "give one boolean SQL expression"),
])
def test_bad_predicate_one_line_exit_2_nothing_written(tmp_path, coco_shards, coco_scores, capsys, predicate,
                                                       duckdb_says):
    out = tmp_path / "out"
    code, stdout, err = run_cli(["filter", str(coco_shards), "--scores", str(coco_scores), "--where", predicate,
                                 "--out", str(out)], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and duckdb_says in lines[0], err
    assert list(tmp_path.iterdir()) == []  # neither the output nor a staged temp directory


def test_moved_dataset_is_matched_and_a_changed_shard_is_refused(tmp_path, coco_shards, coco_scores):
    moved = tmp_path / "moved"
    shutil.copytree(coco_shards, moved)
    result = filter_dataset(open_dataset(str(moved)), coco_scores, tmp_path / "a", where=["sim > -1"])
    assert result.kept_pairs == 16  # matched by file name: the scores still name the old paths

    # Rewrite one shard with its samples in reverse order: same keys, different (shard, index).
    victim = sorted(moved.glob("*.tar"))[1]
    samples = list(wds.WebDataset(str(victim), shardshuffle=False, empty_check=False))
    with wds.TarWriter(str(victim)) as sink:
        for s in reversed(samples):
            sink.write({k: v for k, v in s.items() if not k.startswith("__") or k == "__key__"})
    with pytest.raises(UserError, match="changed since it was scored"):
        filter_dataset(open_dataset(str(moved)), coco_scores, tmp_path / "b", where=["sim > -1"])
    assert not (tmp_path / "b").exists()


def test_unscored_shards_and_missing_rules_are_user_errors(tmp_path, coco_shards, coco_scores):
    stray = tmp_path / "stray.tar"
    shutil.copy(sorted(coco_shards.glob("*.tar"))[0], stray)
    with pytest.raises(UserError, match="have no rows in"):
        filter_dataset(open_dataset([str(coco_shards / "*.tar"), str(stray)]), coco_scores, tmp_path / "x",
                       where=["true"])
    with pytest.raises(UserError, match="at least one rule"):
        filter_dataset(open_dataset(str(coco_shards)), coco_scores, tmp_path / "x")
    with pytest.raises(UserError, match="keep none"):
        filter_dataset(open_dataset(str(coco_shards)), coco_scores, tmp_path / "x", where=["sim > 2"])
    with pytest.raises(UserError, match="top_fraction must be within"):
        filter_dataset(open_dataset(str(coco_shards)), coco_scores, tmp_path / "x", top_fraction=1.5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stray.tar"]


def test_members_keep_name_case_and_gzip_bytes(tmp_path):
    """Member names and bytes as stored: no lower-casing of .JPG, no second gzip of .json.gz."""
    shard = tmp_path / "odd-000000.tar"
    jpeg = (Path(__file__).parent / "data" / "coco-mini" / "val2017").glob("*.jpg")
    image = next(jpeg).read_bytes()
    members = []
    for i in range(3):
        members += [(f"s{i}.JPG", image), (f"s{i}.json.gz", gzip.compress(b'{"caption": "x%d"}' % i)),
                    (f"s{i}.txt", f"caption {i}".encode())]
    with tarfile.open(shard, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    scores = tmp_path / "scores.parquet"
    pq.write_table(pa.table({"key": ["s0", "s1", "s2"], "shard": [str(shard)] * 3, "index": [0, 1, 2],
                             "sim": pa.array([0.3, -0.2, 0.1], pa.float32())}), scores)
    result = filter_dataset(open_dataset(str(shard)), scores, tmp_path / "out", where=["sim > 0"])
    assert result.kept_pairs == 2
    written = [m for f in result.output_files for m in tar_members(Path(f))]
    assert sorted(written) == sorted(m for m in members if m[0].split(".")[0] in ("s0", "s2"))


@pytest.fixture(scope="module")
def parquet_scored(tmp_path_factory, coco_parquet):
    """coco_parquet rewritten with 5-row row groups (so filtering crosses row groups), and its scores."""
    root = tmp_path_factory.mktemp("pq-rg")
    path = root / "pairs.parquet"
    pq.write_table(pq.read_table(coco_parquet), path, row_group_size=5)
    return path, tiny_scores(path, root / "scores.parquet")


def test_parquet_in_parquet_out_rows_equal_the_query(tmp_path, parquet_scored):
    path, scores = parquet_scored
    expected = duckdb_rows(scores, "WHERE sim >= (SELECT median(sim) FROM read_parquet('"
                           f"{scores}')) ORDER BY \"index\"")
    out = tmp_path / "pq-out"
    result = filter_dataset(open_dataset(str(path)), scores, out,
                            where=["sim >= (SELECT median(sim) FROM scores)"])
    assert result.kept_pairs == len(expected) == 8
    kept = pq.read_table(result.output_files)
    source = pq.read_table(path)
    assert kept.schema == source.schema
    assert kept.to_pylist() == source.take([i for _, i, _ in expected]).to_pylist()  # image bytes included
    assert pq.ParquetFile(result.output_files[0]).metadata.num_row_groups == 2  # re-packed to 5 rows per group
    assert load_manifest(out / "manifest.yaml").format == "parquet"

    dry = filter_dataset(open_dataset(str(path)), scores, out, where=["sim >= (SELECT median(sim) FROM scores)"],
                         dry_run=True)
    assert dry.bytes_estimated and 0 < dry.kept_bytes < dry.total_bytes


def test_a_scores_file_that_is_not_there_is_not_found(tmp_path, capsys):
    """Before: "give the scores file alone (...), or the shards with --scores scores.parquet"."""
    code, _, err = run_cli(["filter", tmp_path / "nothere.parquet", "--where", "NOT gmm_noisy", "--out",
                            tmp_path / "kept"], capsys)
    assert code == 2 and err.strip() == f"error: scores file not found: {tmp_path / 'nothere.parquet'}"
    code, _, err = run_cli(["filter", tmp_path / "nothere", "--scores", tmp_path / "nothere.parquet", "--out",
                            tmp_path / "kept"], capsys)
    assert code == 2 and "not found" in err and not (tmp_path / "kept").exists()
