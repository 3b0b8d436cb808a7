"""Shard patterns and manifests resolve to the same ordered shard list."""

import pytest

from pairclean.errors import UserError
from pairclean.data.dataset import open_dataset
from pairclean.data.patterns import resolve_shards


def test_directory_glob_brace_and_list_file_agree(coco_shards, tmp_path):
    expected = [str(coco_shards / f"coco-mini-{i:06d}.tar") for i in range(3)]
    assert resolve_shards(str(coco_shards)) == expected
    assert resolve_shards(str(coco_shards / "*.tar")) == expected
    assert resolve_shards(str(coco_shards / "coco-mini-{000000..000002}.tar")) == expected
    listing = tmp_path / "shards.txt"
    listing.write_text("# my shards\n" + "\n".join(expected) + "\n")
    assert resolve_shards(str(listing)) == expected


def test_manifest_resolves_relative_shards(coco_shards):
    spec = open_dataset(str(coco_shards / "manifest.yaml")).spec
    assert spec.format == "webdataset" and spec.pair == "image-text" and len(spec.shards) == 3
    assert spec.fields.text == "txt" and spec.fields.key == "__key__"


def test_parquet_defaults_and_pipe_refusal(coco_parquet):
    spec = open_dataset(str(coco_parquet)).spec
    assert spec.format == "parquet" and spec.fields.image == "image" and spec.fields.text == "caption"
    with pytest.raises(UserError, match="`allow_pipe`"):
        resolve_shards("pipe:curl -s http://example.invalid/a.tar")


def test_missing_shard_in_brace_pattern_is_named(coco_shards):
    with pytest.raises(UserError, match=r"coco-mini-000003.tar \(and 6 more\)"):
        resolve_shards(str(coco_shards / "coco-mini-{000000..000009}.tar"))


def test_unbalanced_braces_are_a_user_error_and_a_literal_file_is_itself(coco_shards, tmp_path):
    with pytest.raises(UserError, match="unbalanced braces"):
        resolve_shards(str(coco_shards / "coco-mini-{000000..000002.tar"))
    with pytest.raises(UserError, match="unbalanced braces"):
        resolve_shards("s3://bucket/shard-{000..009.tar")
    odd = tmp_path / "shard-{draft.tar"  # braces in a real file's name: the file, not a pattern
    odd.write_bytes((coco_shards / "coco-mini-000000.tar").read_bytes())
    assert resolve_shards(str(odd)) == [str(odd)]
