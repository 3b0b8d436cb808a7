"""`pairclean bench score` (`scoring/bench.py`) on real COCO shards with the tiny model: the
model-only ceiling, the end-to-end run and the naive loop, their ratios and the report."""

from __future__ import annotations

import json

import pytest
import torch

from pairclean.scoring.bench import bench_score
from pairclean.cli import main
from pairclean.errors import UserError


pytestmark = pytest.mark.usefixtures("fresh_notices")


def test_bench_score_cli_measures_all_three_and_prints_ratios(coco_shards, tmp_path, capsys):
    out = tmp_path / "bench.json"
    main(["bench", "score", str(coco_shards), "--model", "pairclean-tiny", "--pretrained", "none",
          "--batch-size", "8", "--workers", "1", "--beta-k", "64", "--naive-pairs", "12", "--min-seconds", "0",
          "--json", str(out)])
    printed = capsys.readouterr().out
    assert "end-to-end / ceiling =" in printed and "end-to-end / naive =" in printed
    assert "2 batches, 2 full, mean fill 100.0% of --batch-size 8" in printed
    assert ("GPU: no CUDA device" in printed) != torch.cuda.is_available()
    (r,) = json.loads(out.read_text())["rounds"]
    assert r["ceiling"]["pairs"] >= 16 and r["end_to_end"]["pairs"] == 16 and r["naive"]["pairs"] == 12
    # 6 + 6 + 4 rows packed into one group (batches span shards, docs/benchmarks.md): two full batches of 8
    assert r["ceiling"]["extra"]["batches_per_pass"] == 2
    assert (r["end_to_end"]["extra"]["batches"], r["end_to_end"]["extra"]["full_batches"]) == (2, 2)
    # The ratios are those of the phases' own throughputs, and the summary prints them.
    assert r["end_to_end_over_ceiling"] == pytest.approx(r["end_to_end"]["pairs_per_second"] /
                                                         r["ceiling"]["pairs_per_second"])
    assert r["end_to_end_over_naive"] == pytest.approx(r["end_to_end"]["pairs_per_second"] /
                                                       r["naive"]["pairs_per_second"])
    assert r["end_to_end"]["pairs_per_second"] == pytest.approx(r["end_to_end"]["pairs"] / r["end_to_end"]["seconds"])
    assert (f"end-to-end / ceiling = {r['end_to_end_over_ceiling']:.2f}, "
            f"end-to-end / naive = {r['end_to_end_over_naive']:.2f}") in printed
    assert r["end_to_end"]["peak_mib"] > 0
    assert r["ceiling"]["extra"]["text_tokens_trimmed"] < r["ceiling"]["extra"]["text_tokens_full"] == 32
    assert r["end_to_end"]["extra"]["beta_source"] in ("computed", "cache")


def test_bench_refuses_bad_settings(coco_shards, fast_config):
    with pytest.raises(UserError, match="repeat must be at least 1"):
        bench_score(str(coco_shards), fast_config, repeat=0)
