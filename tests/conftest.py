"""Shared fixtures: real COCO JPEG shards (tests/data/coco-mini), a tiny open_clip model, fast settings.
Plain helpers (the CLI runner, tiny configs, small datasets) are in helpers.py."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import tiny_scores

from pairclean.lab.coco import build_parquet, build_shards
from pairclean.scoring.model import ScoreConfig

TESTS = Path(__file__).parent
COCO_MINI = TESTS / "data" / "coco-mini"
SHARED_DATA = Path(os.environ.get("PAIRCLEAN_SHARED_DATA", TESTS.parent.parent / "shared" / "data"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """The beta cache of a test session lives in its own temp dir, never in the user's ~/.cache."""
    before = os.environ.get("PAIRCLEAN_CACHE_DIR")
    os.environ["PAIRCLEAN_CACHE_DIR"] = str(tmp_path_factory.mktemp("pairclean-cache"))
    yield
    if before is None:
        os.environ.pop("PAIRCLEAN_CACHE_DIR", None)
    else:
        os.environ["PAIRCLEAN_CACHE_DIR"] = before


@pytest.fixture(scope="session")
def coco_src() -> Path:
    """16 real COCO JPEGs with captions (provenance in tests/data/coco-mini/PROVENANCE.md)."""
    return COCO_MINI


@pytest.fixture(scope="session")
def coco_shards(tmp_path_factory, coco_src) -> Path:
    """The 16 pairs as 3 WebDataset shards (6 + 6 + 4) with a manifest.yaml."""
    out = tmp_path_factory.mktemp("coco") / "shards"
    build_shards(coco_src, out, shard_size=6)
    return out


@pytest.fixture(scope="session")
def coco_parquet(tmp_path_factory, coco_src) -> Path:
    out = tmp_path_factory.mktemp("coco-pq") / "pairs.parquet"
    return build_parquet(coco_src, out)


@pytest.fixture
def fast_config() -> ScoreConfig:
    """The tiny randomly initialised open_clip model with small beta K: seconds per run."""
    return ScoreConfig(model="pairclean-tiny", pretrained="none", beta_k=64, batch_size=8, workers=0, seed=0)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not beside this checkout")
    return SHARED_DATA


@pytest.fixture(scope="session")
def coco_scores(tmp_path_factory, coco_shards) -> Path:
    """Scores of coco_shards by the tiny random model, scored once for the query/filter/report tests."""
    return tiny_scores(coco_shards, tmp_path_factory.mktemp("coco-scores") / "scores.parquet")


@pytest.fixture(scope="session")
def truth(tmp_path_factory, coco_scores) -> Path:
    """Truth labels for coco_scores in the `pairclean corrupt` layout (key, shard, index, noisy):
    every third pair noisy."""
    t = pq.read_table(coco_scores, columns=["key", "shard", "index"])
    path = tmp_path_factory.mktemp("truth") / "truth.parquet"
    pq.write_table(t.append_column("noisy", pa.array([i % 3 == 0 for i in t["index"].to_pylist()])), path)
    return path


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models on a shared 2-core machine: a second intra-op thread only spin-waits
    (OpenMP contention made steps up to 10x slower). Modules opt in with `usefixtures`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_estimator():
    """The tiny randomly initialised open_clip model as a frozen estimator on the CPU (seed 0)."""
    import torch

    from pairclean.backends.open_clip import OpenClipEstimator

    torch.manual_seed(0)
    return OpenClipEstimator("pairclean-tiny", pretrained="none", device="cpu")


@pytest.fixture
def fresh_notices():
    """The test sees its own once-only notices (ops.notices.notice_once), not ones an earlier test said."""
    import pairclean.ops.notices as notices

    notices._said.clear()
    yield
