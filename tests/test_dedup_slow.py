"""The dedup benchmarks end to end at small scale (benchmarks/dedup_quality.py, dedup_scale.py,
save_embeddings_cost.py): slow, run with -m slow. The quality run needs the toy estimator (the
cache `pairclean demo` fills; trained here when it is missing)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_keeping_the_cleanest_copy_keeps_fewer_wrong_captions(tmp_path):
    script("dedup_quality").main(["--only", "toy", "--only", "clean", "--toy-pairs", "600", "--workdir",
                                  str(tmp_path), "--json", str(tmp_path / "q.json")])
    report = json.loads((tmp_path / "q.json").read_text())
    assert report["toy"]["image:0.999"]["kinds"]["exact"]["recall"] == 100.0
    clean = report["clean"]
    assert clean["cleanest"]["planted_groups_one_kept"] > 20
    assert clean["cleanest"]["kept_noisy_share"] < clean["semdedup"]["kept_noisy_share"]


def test_scale_runner_measures_a_run(tmp_path):
    script("dedup_scale").main(["--rows", "20000", "--dim", "32", "--workdir", str(tmp_path), "--json",
                                str(tmp_path / "s.json")])
    (result,) = json.loads((tmp_path / "s.json").read_text())
    assert result["rows"] == 20000 and result["peak_rss_mib"] > 0 and result["text_bytes_allocated"] < 1 << 20
    assert result["removed"] > 0 and not (tmp_path / "rows-20000").exists()  # the data is deleted


def test_save_embeddings_cost_runner(tmp_path):
    script("save_embeddings_cost").main(["--toy-pairs", "200", "--vit-pairs", "0", "--repeat", "1", "--workdir",
                                         str(tmp_path), "--json", str(tmp_path / "c.json")])
    (result,) = json.loads((tmp_path / "c.json").read_text())
    assert result["pairs"] == 200 and 100 < result["bytes_per_pair"] < 1000
