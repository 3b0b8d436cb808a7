"""`pairclean bench score` (`scoring/bench.py`) on real COCO shards with the tiny model: the
model-only ceiling, the end-to-end run and the naive loop, their ratios and the report."""

from __future__ import annotations

import json

import pytest
import torch

from pairclean.bench.score import bench_score
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


def test_the_report_is_written_after_each_phase_so_a_cut_run_keeps_what_it_measured(coco_shards, fast_config, tmp_path,
                                                                                     monkeypatch):
    """A bench stopped during (c) - a device script's timeout - leaves a report with (a) and (b).
    Broken variant caught: the report written once, at the end (89907df): no file at all."""
    from pairclean.ops.guard import open_output
    from pairclean.bench import score as bench

    def cut(*args, **kwargs):
        raise KeyboardInterrupt  # what the timeout's SIGTERM becomes, in kind

    monkeypatch.setattr(bench, "measure_naive", cut)
    out = tmp_path / "bench.json"
    with pytest.raises(KeyboardInterrupt):
        bench_score(str(coco_shards), fast_config, min_seconds=0, out=open_output(out))
    (r,) = json.loads(out.read_text())["rounds"]
    assert r["ceiling"]["pairs"] >= 16 and r["end_to_end"]["pairs"] == 16 and r["naive"] is None
    assert r["end_to_end_over_ceiling"] == pytest.approx(r["end_to_end"]["pairs_per_second"] /
                                                         r["ceiling"]["pairs_per_second"])


def test_the_ceiling_reads_each_batch_back_after_queuing_the_next(coco_shards, tiny_estimator, monkeypatch):
    """As the pipeline's sink does: the host queues batch i+1 before it waits for batch i's sims, so
    on a GPU the device never idles between batches of the ceiling. Broken variant caught: a read of
    each batch as it is queued (89907df's `.cpu()`: no batch was ever behind)."""
    from pairclean.backends.feed import HostCopies
    from pairclean.data.dataset import as_dataset
    from pairclean.bench.score import measure_ceiling

    events, init, wait = [], HostCopies.__init__, HostCopies.wait

    def queued(self, tensors=None):
        init(self, tensors)
        self.tag = sum(kind == "queue" for kind, _ in events)
        events.append(("queue", self.tag))

    monkeypatch.setattr(HostCopies, "__init__", queued)
    monkeypatch.setattr(HostCopies, "wait", lambda self: events.append(("read", self.tag)) or wait(self))
    phase = measure_ceiling(tiny_estimator, as_dataset(str(coco_shards)), 4, min_seconds=0)
    reads = [at for at, (kind, _) in enumerate(events) if kind == "read"]
    behind = [at for at in reads if any(kind == "queue" and k > events[at][1] for kind, k in events[:at])]
    assert sorted(events[at][1] for at in reads) == list(range(len(reads))) == [k for kind, k in events if kind == "queue"]
    # each warm-up shape is read at once (its own drain), and the last batch by the final drain
    assert len(behind) == len(reads) - phase.extra["warmup_shapes"] - 1 > 0


def test_a_compile_that_fell_back_is_in_the_report_and_said(coco_shards, tmp_path, monkeypatch, capsys):
    """`--compile` whose towers fell back to eager: the report's config and the end-to-end phase say
    which tower ran eager and why, and the summary says so: a `compile` figure is never an eager one
    unawares."""
    def failing(fn, **kwargs):
        def compiled(*args):
            raise RuntimeError("inductor: no working C++ compiler")
        return compiled

    monkeypatch.setattr(torch, "compile", failing)
    out = tmp_path / "bench.json"
    main(["bench", "score", str(coco_shards), "--model", "pairclean-tiny", "--pretrained", "none", "--compile",
          "--batch-size", "8", "--workers", "1", "--beta-mode", "shuffled", "--naive-pairs", "0", "--min-seconds", "0",
          "--json", str(out)])
    report = json.loads(out.read_text())
    why = "eager after: RuntimeError: inductor: no working C++ compiler"
    assert report["config"]["compiled_towers"] == {"image": why, "text": why}
    assert report["rounds"][0]["end_to_end"]["extra"]["compiled_towers"]["image"] == why
    assert f"compile asked, but the image tower ran {why}" in capsys.readouterr().out
