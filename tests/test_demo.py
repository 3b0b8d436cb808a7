"""`pairclean demo` end to end with a small recipe: every stage, the files it promises, the cache."""

from __future__ import annotations

import json
import shutil

import duckdb
import pyarrow.parquet as pq
import pytest

from pairclean.cli import main
from pairclean.lab.demo import DemoConfig, run_demo
from pairclean.errors import UserError
from pairclean.lab.synth.estimator import CHECKPOINT, EstimatorRecipe

pytestmark = pytest.mark.usefixtures("one_torch_thread")


SMALL = EstimatorRecipe(pairs=32, batch_size=16, epochs=1, warmup_steps=1)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    cfg = DemoConfig(out=root / "demo", pairs=40, recipe=SMALL, cache_dir=root / "cache", workers=0, beta_k=64)
    return cfg, run_demo(cfg)


def test_demo_writes_every_stage(first_run):
    cfg, result = first_run
    assert not result.estimator_cached
    assert result.checkpoint == cfg.out / "estimator" / CHECKPOINT
    for name in ("world", "noisy", "truth", "scores", "detection", "summary"):
        assert result.files[name].exists(), name
    rows = duckdb.sql(f"SELECT count(*), count(sim) FROM '{result.files['scores']}'").fetchall()[0]
    assert rows == (40, 40)
    truth = duckdb.sql(f"SELECT count(*) FILTER (WHERE selected), count(*) FILTER (WHERE noisy) "
                       f"FROM '{result.files['truth']}'").fetchall()[0]
    assert truth[0] == 20 and result.metrics.noisy == truth[1]
    assert result.metrics.pairs == 40 and set(result.metrics.rules) == {"beta", "gmm", "oracle"}
    assert json.loads(result.files["detection"].read_text())["roc_auc"] == pytest.approx(result.metrics.roc_auc)
    summary = json.loads(result.files["summary"].read_text())
    assert set(summary["seconds"]) == {"estimator", "world", "corrupt", "score", "evaluate", "total"}
    assert summary["estimator_cached"] is False
    # PIL's pixels, the same on every CPU (torch's resize follows the instruction set): trained and scored alike
    scored = json.loads(pq.read_schema(result.files["scores"]).metadata[b"pairclean"])["estimator"]
    assert scored["decode"] == "exact" and scored["worker_resize"] == "pil"
    trained = json.loads((cfg.out / "estimator" / "run" / "run.json").read_text())["settings"]
    assert trained["decode"] == "exact" and "worker_resize" not in trained


def test_demo_refuses_a_directory_that_is_not_its_own(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="not a demo output"):
        run_demo(DemoConfig(out=tmp_path / "mine", recipe=SMALL, cache_dir=tmp_path / "cache"))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_cli_demo_reuses_the_cached_estimator_and_repeats_the_figures(first_run, tmp_path, monkeypatch, capsys):
    _, first = first_run
    cache = tmp_path / "cache"
    monkeypatch.setenv("PAIRCLEAN_CACHE_DIR", str(cache))
    entry = cache / "toy-estimator" / EstimatorRecipe().cache_key()  # the default recipe's slot
    entry.mkdir(parents=True)
    shutil.copyfile(first.checkpoint, entry / CHECKPOINT)
    main(["demo", "--out", str(tmp_path / "out"), "--pairs", "40", "--workers", "0", "--beta-k", "64"])
    out = capsys.readouterr().out
    assert "oracle" in out and "ROC-AUC" in out and "93.88 / 97.49" in out
    assert "from the cache" in out and "scores.parquet" in out
    assert "README's band is for the default demo (2,000 pairs, 50% noise, seed 0, K 1024): not compared" in out
    assert not (tmp_path / "out" / "estimator").exists()  # nothing trained
    again = json.loads((tmp_path / "out" / "detection.json").read_text())
    assert again["roc_auc"] == first.metrics.roc_auc  # same world, noise, weights: same figures
    assert again["rules"] == first.metrics.to_json()["rules"]


def test_the_demo_pins_the_cpu_arithmetic_before_torch_starts(first_run, tmp_path):
    """Machines differ in the instruction set of torch's kernels (and oneDNN's, MKL's) and in their
    threads: the demo fixes both (lab/numerics.py). A child process stands for a machine whose own
    setting would be the scalar kernels; the pin, made before torch starts, wins."""
    import os
    import subprocess
    import sys

    import torch

    from pairclean.lab.numerics import CPU_NUMERICS, numerics_pinned, pin_cpu_numerics

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("not an x86-64 CPU with AVX2")
    before = dict(os.environ)
    assert pin_cpu_numerics() is False and dict(os.environ) == before  # torch is running here: too late
    assert not numerics_pinned()  # so the demo says its table may differ
    child = ("from pairclean.lab.numerics import pin_cpu_numerics, cpu_numerics\n"
             "assert pin_cpu_numerics()\nimport torch\nprint(cpu_numerics())")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"}
    printed = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, check=True).stdout
    assert printed.strip() == str({"capability": "AVX2", "ONEDNN_MAX_CPU_ISA": CPU_NUMERICS["ONEDNN_MAX_CPU_ISA"],
                                   "MKL_CBWR": CPU_NUMERICS["MKL_CBWR"]})
    # The threads are the recipe's, and both are part of what a cached estimator is filed under.
    summary = json.loads(first_run[1].files["summary"].read_text())
    assert summary["cpu"]["capability"] == torch.backends.cpu.get_cpu_capability()
    assert EstimatorRecipe(threads=1).cache_key() != EstimatorRecipe().cache_key()


def test_the_cli_starts_without_torch_so_the_demo_can_fix_its_arithmetic():
    """Every command module is imported when the CLI starts: none may start torch (ATen, oneDNN and
    MKL read the demo's pin when torch starts), and a slow import would tax every command."""
    import subprocess
    import sys

    child = ("import sys\nfrom pairclean.cli import _register_commands\n_register_commands()\n"
             "print(sorted(m for m in ('torch', 'open_clip', 'sklearn') if m in sys.modules))")
    printed = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout
    assert printed.strip() == "[]"


def test_readme_states_the_band_the_demo_checks_its_figures_against():
    """README's band and the demo's (lab/demo.py BAND) are one set of numbers."""
    import re
    from pathlib import Path

    from pairclean.lab.demo import BAND

    text = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
    found = re.search(r"README's band: beta ([0-9.]+) to ([0-9.]+), beta's noise caught ([0-9.]+) to ([0-9.]+)%, GMM "
                      r"balanced accuracy ([0-9.]+) to ([0-9.]+)%, oracle balanced accuracy ([0-9.]+) to ([0-9.]+)%, "
                      r"ROC-AUC ([0-9.]+) to ([0-9.]+)", text)
    assert found, "README states no band"
    stated = [float(x) for x in found.groups()]
    assert stated == [bound for name in ("beta", "beta_caught", "gmm_balanced", "oracle_balanced", "roc_auc")
                      for bound in BAND[name]]
    assert all(low < high for low, high in BAND.values())


def test_the_demo_says_whether_its_figures_are_inside_the_band():
    from pairclean.cli.lab import band_line
    from pairclean.lab.demo import BAND, DemoConfig, band_check

    inside = {name: sum(band) / 2 for name, band in BAND.items()}
    assert band_line(band_check(inside)).startswith("every figure is inside README's band")
    outside = {**inside, "roc_auc": BAND["roc_auc"][0] - 0.001}
    line = band_line(band_check(outside))
    assert line.startswith("outside README's band (measured across machines, docs/lab.md): ROC-AUC ")
    assert f"(band {BAND['roc_auc'][0]:g} to {BAND['roc_auc'][1]:g})" in line and "beta" not in line
    assert DemoConfig().default_table() and not DemoConfig(pairs=40).default_table()
    assert not DemoConfig(ratio=0.2).default_table() and DemoConfig(workers=0).default_table()
