"""The input-format registry: each layout detected from its files (and forced by name), no format
branch outside data/, shard patterns counted before they are expanded, key lists in and out."""

from __future__ import annotations

import re
from pathlib import Path

import braceexpand
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import run_cli

from pairclean.data.embeddings import LAYOUTS
from pairclean.data.formats import REGISTRY, detect
from pairclean.data.embeddings import open_embeddings
from pairclean.data.keys import read_keys, uid_pairs, write_keys
from pairclean.data.dataset import open_dataset
from pairclean.data.patterns import MAX_PATTERN_NAMES, _count_names
from pairclean.errors import ConfigError, UserError

ROOT = Path(__file__).parent.parent
ECO = Path(__file__).parent / "data" / "ecosystem"


@pytest.mark.parametrize("source, name, shards, key", [
    (ECO / "img2dataset" / "webdataset", "img2dataset-webdataset", 2, "__key__"),
    (ECO / "img2dataset" / "webdataset" / "*.tar", "img2dataset-webdataset", 2, "__key__"),  # sidecars found beside
    (ECO / "img2dataset" / "parquet", "img2dataset-parquet", 2, "key"),
    (ECO / "hf-datasets" / "hub", "hf-parquet", 3, "id"),
    (ECO / "hf-datasets" / "path-only" / "data", "hf-parquet", 1, "id"),
    (ECO / "datacomp" / "shards", "datacomp-shards", 2, "uid"),
    (ECO / "datacomp" / "resharded", "webdataset", 2, "__key__"),
])
def test_each_layout_is_detected_from_its_files(source, name, shards, key):
    spec = open_dataset(str(source)).spec
    assert (spec.format, len(spec.shards), spec.fields.key) == (name, shards, key)
    assert spec.shards == sorted(spec.shards) and all(s.endswith((".tar", ".parquet")) for s in spec.shards)


@pytest.mark.parametrize("source, layout", [
    (ECO / "clip-retrieval", "clip-retrieval"), (ECO / "datacomp", "datacomp-npz"),
    (ECO / "datacomp" / "metadata", "datacomp-npz"),
])
def test_each_embeddings_layout_is_detected(source, layout):
    spec = open_embeddings(str(source))
    assert spec.layout == layout and spec.key_field == ("uid" if "datacomp" in layout else "key")


def test_a_format_is_forced_by_name_and_an_unknown_one_is_named(tmp_path, capsys):
    spec = open_dataset(str(ECO / "img2dataset" / "webdataset"), format="webdataset").spec
    assert spec.format == "webdataset" and [Path(s).suffix for s in spec.shards] == [".tar", ".tar"]
    with pytest.raises(ConfigError, match="unknown input format 'nope'"):
        open_dataset(str(ECO / "img2dataset" / "webdataset"), format="nope")
    code, _, err = run_cli(["score", ECO / "img2dataset" / "parquet", "--input-format", "nope",
                            "--out", tmp_path / "s.parquet"], capsys)
    assert code == 2 and "for --input-format; choose one of" in err and "hf-parquet" in err


def test_tars_and_parquet_that_are_not_img2dataset_output_are_named_not_mixed(tmp_path):
    (tmp_path / "a.tar").write_bytes(b"")
    pq.write_table(pa.table({"x": [1]}), tmp_path / "b.parquet")
    with pytest.raises(UserError, match="cannot tell the format of 2 input file"):
        open_dataset(str(tmp_path))


def test_every_registered_format_and_layout_has_a_label():
    assert set(REGISTRY) == {"webdataset", "parquet", "img2dataset-webdataset", "datacomp-shards",
                             "img2dataset-parquet", "hf-parquet"}
    assert set(LAYOUTS) == {"clip-retrieval", "numpy", "parquet-embeddings", "datacomp-npz"}
    assert all(cls.label for cls in [*REGISTRY.values(), *LAYOUTS.values()])


def test_no_module_outside_data_branches_on_a_format_name():
    """One home per input format: code outside pairclean/data/ asks the format object, it never
    compares a dataset's format (or an embeddings layout) with a name. (A bare "parquet" is also
    `query`'s output format, so only the attribute comparison catches it.)"""
    branch = re.compile(r"\.(format|layout)\s*(==|!=|\bin\b|\bnot\s+in\b)|"
                        r"[=!]=\s*[\"'](webdataset|img2dataset-[a-z]+|hf-parquet|datacomp-[a-z]+|"
                        r"clip-retrieval|numpy|parquet-embeddings)[\"']")
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in sorted((ROOT / "pairclean").rglob("*.py")) if "data" not in path.relative_to(ROOT).parts[1:2]
             for n, line in enumerate(path.read_text().splitlines(), 1) if branch.search(line.split("#")[0])]
    assert not found, "format branches outside data/:\n" + "\n".join(found)


@pytest.mark.parametrize("pattern", ["s-{000..009}.tar", "{a..e}/{1..3}.tar", "x{,.backup}", "p{2.{5..7},3.{2,3}}",
                                     "{07..10}", "{4..1..2}", "{a}", r"{1\{2,3}", "plain.tar", "{10..1..3}"])
def test_names_are_counted_as_braceexpand_makes_them(pattern):
    assert _count_names(pattern) == len(list(braceexpand.braceexpand(pattern)))


def test_a_huge_brace_pattern_is_refused_without_expanding_it(tmp_path):
    with pytest.raises(UserError, match=f"names 1,000,000,000 shards, more than {MAX_PATTERN_NAMES:,}"):
        open_dataset(str(tmp_path / "x-{1..1000000000}.tar"))
    with pytest.raises(UserError, match="unbalanced braces"):
        open_dataset(str(tmp_path / "x-{1..3.tar"))


def test_key_lists_read_and_write_datacomps_uid_arrays(tmp_path):
    subset = ECO / "datacomp" / "subset" / "b32_top_half.npy"
    keys = read_keys(subset).to_pylist()
    assert len(keys) == 8 and all(len(k) == 32 and int(k, 16) >= 0 for k in keys)
    metadata = pq.read_table(next((ECO / "datacomp" / "metadata").glob("*.parquet"))).column("uid").to_pylist()
    assert set(keys) <= set(metadata)
    write_keys(tmp_path / "back.npy", reversed(keys))
    np.testing.assert_array_equal(np.load(tmp_path / "back.npy"), np.load(subset))  # sorted, as DataComp writes them
    np.load(subset).tofile(tmp_path / "raw.npy")  # no .npy header: read as the resharder reads it, a raw array
    assert read_keys(tmp_path / "raw.npy").to_pylist() == keys
    write_keys(tmp_path / "k.txt", ["a", "b"])
    write_keys(tmp_path / "k.parquet", ["a", "b"])
    assert read_keys(tmp_path / "k.txt").to_pylist() == read_keys(tmp_path / "k.parquet").to_pylist() == ["a", "b"]
    with pytest.raises(UserError, match="not a DataComp uid"):
        uid_pairs(["000003"])


def test_a_compressed_npz_is_refused_with_the_fix(tmp_path):
    np.savez_compressed(tmp_path / "x.npz", b32_img=np.ones((3, 4), np.float16), b32_txt=np.ones((3, 4), np.float16))
    with pytest.raises(UserError, match="compressed .*save it with np.savez"):
        open_embeddings(str(tmp_path / "x.npz"))


def test_an_error_reason_is_cut_before_it_is_stored(tmp_path):
    from pairclean.scoring.parts import MAX_ERROR_CHARS, part_table

    part = part_table({"key": ["k"], "shard": ["s"], "index": [0], "sim": [None], "error": ["x" * 10_000]})
    (error,) = part.table.column("error").to_pylist()
    assert len(error) == MAX_ERROR_CHARS


def test_a_split_that_does_not_exist_names_the_ones_that_do():
    with pytest.raises(UserError, match="no file of split 'validation'.*splits: test, train"):
        detect(sorted(str(p) for p in (ECO / "hf-datasets" / "hub" / "data").glob("*.parquet")), split="validation")
