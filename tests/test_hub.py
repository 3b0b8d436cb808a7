"""Model files offline: pretrained tags, hf-hub: models and sentence-transformers models that are
neither cached nor reachable are refused before any download (no minute of retries), with the whole
message and the ways forward; cached ones are used. A checkpoint given with the wrong model names
the model it holds."""

from __future__ import annotations

import json
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


@pytest.mark.parametrize("model, what", [
    ("ViT-B-16-SigLIP", "the tokenizer files of ViT-B-16-SigLIP (timm/ViT-B-16-SigLIP)"),
    ("xlm-roberta-base-ViT-B-32", "the tokenizer files of xlm-roberta-base-ViT-B-32 (xlm-roberta-base)")])
def test_a_tokenizer_from_the_hub_is_refused_before_the_retries_even_with_random_weights(no_hub, model, what):
    """Random weights still need the Hub's tokenizer (and text config) files: before this, a
    minute of retries and an OSError."""
    with pytest.raises(ConfigError) as caught:
        OpenClipEstimator(model, pretrained="none", device="cpu")
    message = str(caught.value)
    assert message.startswith(f"cannot fetch {what}: 127.0.0.1 cannot be reached (") and caught.value.fields == ("model",)
    assert "Choose a `model` whose tokenizer and text tower come with open_clip" in message


def test_a_hub_text_model_config_is_checked_once_its_tokenizer_is_cached(no_hub):
    repo = no_hub / "models--xlm-roberta-base"
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "tokenizer_config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    with pytest.raises(ConfigError, match=r"^cannot fetch the text model's config of xlm-roberta-base-ViT-B-32 "
                                          r"\(xlm-roberta-base\): 127.0.0.1 cannot be reached"):
        OpenClipEstimator("xlm-roberta-base-ViT-B-32", pretrained="none", device="cpu")


def test_cached_weights_are_used_and_the_retries_announced(no_hub, caplog, monkeypatch):
    snapshot = no_hub / f"models--{REPO.replace('/', '--')}" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / FILES[1]).write_bytes(b"weights")
    (no_hub / f"models--{REPO.replace('/', '--')}" / "refs").mkdir()
    (no_hub / f"models--{REPO.replace('/', '--')}" / "refs" / "main").write_text("0" * 40)
    with caplog.at_level(logging.WARNING, logger="pairclean"):
        check_fetchable("the weights 'openai' of ViT-B-32", REPO, FILES)  # no error: open_clip finds them in the cache
    assert "127.0.0.1 cannot be reached" in caplog.text and "HF_HUB_OFFLINE=1 skips them" in caplog.text
    caplog.clear()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # said by the user: nothing to announce
    with caplog.at_level(logging.WARNING, logger="pairclean"):
        check_fetchable("the weights 'openai' of ViT-B-32", REPO, FILES)
    assert caplog.text == ""


def _cache_repo(hub, repo: str, files: dict[str, bytes]) -> None:
    """Files of a Hub repository laid out as huggingface_hub's cache keeps them."""
    folder = hub / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0" * 40)


def test_an_hf_hub_name_is_a_model_and_offline_it_fails_as_a_fetch(no_hub, coco_shards, tmp_path, capsys):
    """LAION's and DataComp's models are named hf-hub:ORG/REPO: not an unknown model, a fetch that
    cannot be made here, said in seconds with the ways forward."""
    code, out, err = run_cli(["score", coco_shards, "--out", tmp_path / "s.parquet",
                              "--model", "hf-hub:laion/CLIP-ViT-B-32-laion2B-s34B-b79K"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: cannot fetch the config of hf-hub:laion/CLIP-ViT-B-32-laion2B-s34B-b79K: "
                               "127.0.0.1 cannot be reached")
    assert "Give an architecture name with a local checkpoint file (e.g. ViT-B-32 with --pretrained PATH)" in lines[0]
    assert not (tmp_path / "s.parquet").exists()
    _cache_repo(no_hub, "laion/CLIP-ViT-B-32-laion2B-s34B-b79K", {"open_clip_config.json": b"{}"})  # weights absent
    code, out, err = run_cli(["score", coco_shards, "--out", tmp_path / "s.parquet",
                              "--model", "hf-hub:laion/CLIP-ViT-B-32-laion2B-s34B-b79K"], capsys)
    assert code == 2 and "cannot fetch the weights of hf-hub:laion/CLIP-ViT-B-32-laion2B-s34B-b79K" in err
    assert "Give --pretrained none for random weights of its architecture" in err


def test_an_hf_hub_model_loads_from_the_cache_with_its_own_weights(no_hub, monkeypatch, tmp_path):
    """A repository in the Hugging Face cache (config + safetensors, as open_clip publishes them),
    HF_HUB_OFFLINE set: the model is built from its config, its weights are the repository's, and
    `pretrained` other than unset / none is refused."""
    import open_clip
    import torch
    from safetensors.torch import save_file

    from pairclean.backends.open_clip import register_model_configs

    monkeypatch.undo()  # the real create_model_and_transforms; the hub settings again, offline
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(no_hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    register_model_configs()
    torch.manual_seed(3)
    net = open_clip.create_model("pairclean-tiny")
    config = {"model_cfg": open_clip.get_model_config("pairclean-tiny"),
              "preprocess_cfg": {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]}}
    weights = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(weights))
    _cache_repo(no_hub, "pairclean/tiny", {"open_clip_config.json": json.dumps(config).encode(),
                                           "open_clip_model.safetensors": weights.read_bytes()})
    estimator = OpenClipEstimator("hf-hub:pairclean/tiny", device="cpu")
    assert estimator.pretrained == "hf-hub:pairclean/tiny" and not estimator.random_init
    assert all(torch.equal(a, b) for a, b in zip(estimator.model.state_dict().values(), net.state_dict().values()))
    assert estimator.mean == [0.5, 0.5, 0.5]  # the repository's preprocessing
    random = OpenClipEstimator("hf-hub:pairclean/tiny", pretrained="none", device="cpu")
    assert random.random_init
    with pytest.raises(ConfigError, match="brings its own weights: leave `pretrained` unset"):
        OpenClipEstimator("hf-hub:pairclean/tiny", pretrained="openai", device="cpu")


def test_a_sentence_model_that_is_not_cached_fails_in_seconds(no_hub, coco_src, tmp_path, capsys):
    """Before: 83 s of huggingface_hub retries (3 files x 1+2+4+8+8 s) before the same failure."""
    import time

    from helpers import text_pairs

    shards = text_pairs(coco_src, tmp_path / "tt")
    started = time.perf_counter()
    code, out, err = run_cli(["score", shards, "--out", tmp_path / "s.parquet", "--backend", "sentence-transformers",
                              "--model", "all-mpnet-base-v2", "--workers", "0"], capsys)
    assert time.perf_counter() - started < 30
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: cannot load sentence-transformers model 'all-mpnet-base-v2': it is neither a "
                               "local directory nor in the Hugging Face cache")
    assert "127.0.0.1 cannot be reached" in lines[0] and "Give --model a local model directory" in lines[0]


def test_a_checkpoint_given_with_the_wrong_model_says_which_model_it_holds(tmp_path, coco_shards, capsys):
    """Before: "cannot load pairclean-tiny with --pretrained toy.pt: text pos_embed width changed!"."""
    import open_clip
    import torch

    from pairclean.backends.open_clip import register_model_configs

    register_model_configs()
    torch.save(open_clip.create_model("pairclean-toy").state_dict(), tmp_path / "toy.pt")
    code, out, err = run_cli(["score", coco_shards, "--out", tmp_path / "s.parquet", "--model", "pairclean-tiny",
                              "--pretrained", tmp_path / "toy.pt", "--workers", "0"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert f"{tmp_path / 'toy.pt'} holds pairclean-toy (a ViT of width 96, 3 layers, 8-px patches on 48-px images" \
        in lines[0]
    assert lines[0].endswith("give --model pairclean-toy")
