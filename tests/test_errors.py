"""The library words a bad setting by its config field; the CLI by its flag (one mechanism)."""

from __future__ import annotations

import pytest

from pairclean.cli import main
from pairclean.errors import ConfigError
from pairclean.scoring.model import ScoreConfig, score


def test_library_names_the_config_field(coco_shards, tmp_path):
    with pytest.raises(ConfigError) as caught:
        score(str(coco_shards), tmp_path / "s.parquet", ScoreConfig(batch_size=0))
    assert str(caught.value) == "batch_size must be at least 1, got 0" and caught.value.fields == ("batch_size",)
    assert not (tmp_path / "s.parquet").exists()


def test_cli_names_the_flag(coco_shards, tmp_path, capsys):
    with pytest.raises(SystemExit) as code:
        main(["score", str(coco_shards), "--out", str(tmp_path / "s.parquet"), "--beta-mode", "fixed",
              "--model", "pairclean-tiny", "--pretrained", "none"])
    err = capsys.readouterr().err.strip()
    assert code.value.code == 2 and err == "error: --beta-mode fixed needs --beta set to a value", err


def test_field_names_are_replaced_as_whole_words():
    exc = ConfigError("beta_mode fixed needs beta; beta_k is unused", "beta_mode", "beta", "beta_k")
    assert exc.worded(lambda f: "--" + f.replace("_", "-")) == "--beta-mode fixed needs --beta; --beta-k is unused"
