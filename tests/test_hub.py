"""Pretrained tags offline: weights that are neither cached nor reachable are refused before any
download (no minute of retries), with the whole message and the ways forward; cached ones are used."""

from __future__ import annotations

import logging

import pytest
from huggingface_hub import constants

from helpers import run_cli
from pairclean.backends.hub import check_fetchable
from pairclean.backends.open_clip import OpenClipEstimator
from pairclean.errors import ConfigError

REPO, FILES = "timm/vit_base_patch32_clip_224.openai", ["open_clip_model.safetensors", "open_clip_pytorch_model.bin"]


@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    """An empty Hugging Face cache, a hub that refuses connections, and a download that must not start."""
    import open_clip

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)

    def no_download(*args, **kwargs):
        raise AssertionError("the download started")

    monkeypatch.setattr(open_clip, "create_model_and_transforms", no_download)
    return tmp_path / "hub"


def test_an_unreachable_hub_is_refused_before_the_download(no_hub):
    with pytest.raises(ConfigError) as caught:
        OpenClipEstimator("ViT-B-32", pretrained="openai", device="cpu")
    message = str(caught.value)
    assert message.startswith("cannot fetch the weights 'openai' of ViT-B-32: 127.0.0.1 cannot be reached (")
    assert f"not in the Hugging Face cache ({no_hub})" in message
    assert "`pretrained` a local checkpoint file" in message and "`pretrained` none for random weights" in message
    assert message.endswith("(HF_HUB_OFFLINE=1 then skips the network)") and caught.value.fields == ("pretrained",)


def test_hf_hub_offline_is_believed_without_a_probe(no_hub, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr("socket.create_connection", lambda *a, **k: pytest.fail("probed the network"))
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set, and they are not in the Hugging Face cache"):
        OpenClipEstimator("ViT-B-32", pretrained="openai", device="cpu")


def test_the_command_line_says_it_in_one_whole_line_with_flags(no_hub, coco_shards, tmp_path, capsys):
    code, out, err = run_cli(["score", coco_shards, "--out", tmp_path / "s.parquet"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: cannot fetch the weights 'openai'")
    assert "Give --pretrained a local checkpoint file, or --pretrained none for random weights" in lines[0]
    assert lines[0].endswith("(HF_HUB_OFFLINE=1 then skips the network)")


def test_cached_weights_are_used_and_the_retries_announced(no_hub, caplog, monkeypatch):
    snapshot = no_hub / f"models--{REPO.replace('/', '--')}" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / FILES[1]).write_bytes(b"weights")
    (no_hub / f"models--{REPO.replace('/', '--')}" / "refs").mkdir()
    (no_hub / f"models--{REPO.replace('/', '--')}" / "refs" / "main").write_text("0" * 40)
    with caplog.at_level(logging.WARNING, logger="pairclean"):
        check_fetchable("ViT-B-32", "openai", REPO, FILES)  # no error: open_clip finds them in the cache
    assert "127.0.0.1 cannot be reached" in caplog.text and "HF_HUB_OFFLINE=1 skips them" in caplog.text
    caplog.clear()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # said by the user: nothing to announce
    with caplog.at_level(logging.WARNING, logger="pairclean"):
        check_fetchable("ViT-B-32", "openai", REPO, FILES)
    assert caplog.text == ""
