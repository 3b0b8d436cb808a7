"""`score --engine ray` on a real multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`:
a head and two worker nodes, one CPU each, so one scoring worker per node). Every row equals the
local engine's with the same packing (fp32 CPU: bit for bit), on web-style shards and COCO-mini; a
worker node removed after its second commit, and the driver SIGKILLed mid-run then re-run, leave
every pair exactly once with the same values."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import run_cli

from pairclean.lab.coco import build_web_shards
from pairclean.runs import parts_dir_for
from pairclean.scorefile.contract import read_provenance
from pairclean.scoring.model import ScoreConfig, score

ray_cluster_utils = pytest.importorskip("ray.cluster_utils")

TINY = ["--model", "pairclean-tiny", "--pretrained", "none", "--beta-k", "64", "--workers", "0", "--batch-size", "4",
        "--seed", "0", "--group-units", "1", "--no-beta-cache"]
LOCAL = dict(model="pairclean-tiny", pretrained="none", beta_k=64, workers=0, batch_size=4, seed=0, group_units=1,
             beta_cache=False)


@pytest.fixture(scope="module")
def cluster():
    """Three Ray nodes of one CPU each; the driver (a `pairclean score` process) joins by address."""
    cluster = ray_cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    yield cluster, workers
    cluster.shutdown()


@pytest.fixture(scope="module")
def web(tmp_path_factory, coco_src):
    """Web-style shards: 8 of 10 pairs (COCO-mini images cropped, resized, re-encoded)."""
    out = tmp_path_factory.mktemp("ray-web") / "web"
    build_web_shards(coco_src, out, shards=8, pairs_per_shard=10)
    return out


def _local(source: Path, out: Path) -> list[dict]:
    score(str(source), out, ScoreConfig(**LOCAL))
    return pq.read_table(out).to_pylist()


@pytest.fixture(scope="module")
def web_local(web, tmp_path_factory) -> list[dict]:
    """The local engine's rows of the web-style shards: what every Ray run of them must give."""
    return _local(web, tmp_path_factory.mktemp("ray-web-local") / "local.parquet")


def _driver(source: Path, out: Path, address: str, *extra: str, slow: float | None = None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PAIRCLEAN_SLOW", None)
    if slow:
        env["PAIRCLEAN_SLOW"] = f"0:{slow}"  # every worker sleeps after each batch: time to act mid-run
    return subprocess.Popen([sys.executable, "-m", "pairclean", "score", str(source), "--out", str(out), *TINY,
                             "--engine", "ray", "--ray-address", address, *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finished(proc: subprocess.Popen, timeout: float = 300) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return out


def _commits(out: Path) -> list[dict]:
    """The commit records of the run writing `out`, as they stand."""
    found = []
    for path in parts_dir_for(out).glob("part-*.done.json"):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return found


def _wait_for(test, proc: subprocess.Popen, timeout: float = 240):
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        found = test()
        if found:
            return found
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError("timed out")


def test_three_nodes_score_coco_like_the_local_engine(cluster, coco_shards, tmp_path):
    ray_cluster, _ = cluster
    local = _local(coco_shards, tmp_path / "local.parquet")
    _finished(_driver(coco_shards, tmp_path / "ray.parquet", ray_cluster.address))
    assert pq.read_table(tmp_path / "ray.parquet").to_pylist() == local  # every column, bit for bit
    provenance = read_provenance(tmp_path / "ray.parquet")
    assert provenance.engine == "ray" and sum(provenance.units_by_node.values()) == 3
    assert read_provenance(tmp_path / "local.parquet").engine == "local"


def test_a_worker_node_removed_mid_run_loses_and_repeats_nothing(cluster, web, web_local, tmp_path):
    ray_cluster, workers = cluster
    out = tmp_path / "ray.parquet"
    proc = _driver(web, out, ray_cluster.address, slow=0.4)
    doomed = {w.node_id[:12]: w for w in workers}
    node = _wait_for(lambda: next((n for n in doomed if sum(c.get("node") == n for c in _commits(out)) >= 2), None),
                     proc)
    ray_cluster.remove_node(doomed[node], allow_graceful=False)  # its worker dies with it, mid-unit
    try:
        _finished(proc)
        assert pq.read_table(out).to_pylist() == web_local  # every pair once, same values
        assert read_provenance(out).workers_lost == 1
        by_node = read_provenance(out).units_by_node
        assert by_node[node] >= 2 and sum(by_node.values()) == 8 and len(by_node) == 3  # all three nodes worked
    finally:
        workers[workers.index(doomed[node])] = ray_cluster.add_node(num_cpus=1)  # the cluster whole again
        ray_cluster.wait_for_nodes()


def test_the_driver_killed_mid_run_resumes_exactly(cluster, web, web_local, tmp_path):
    ray_cluster, _ = cluster
    out = tmp_path / "ray.parquet"
    proc = _driver(web, out, ray_cluster.address, slow=0.4)
    _wait_for(lambda: len(_commits(out)) >= 2, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists() and parts_dir_for(out).is_dir()
    _finished(_driver(web, out, ray_cluster.address))  # the same command
    assert pq.read_table(out).to_pylist() == web_local


def test_bad_ray_settings_are_one_line_before_any_work(coco_shards, tmp_path, monkeypatch, capsys):
    proc = subprocess.run([sys.executable, "-m", "pairclean", "score", str(coco_shards), "--out",
                           str(tmp_path / "s.parquet"), *TINY, "--engine", "ray", "--ray-address", "127.0.0.1:1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no Ray cluster answers there" in proc.stderr and "--ray-address" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1  # (how long it takes: docs/distributed.md, measured)
    # something else listens there (it accepts connections and says nothing): refused too, in one line
    listener = socket.create_server(("127.0.0.1", 0))
    held = []
    threading.Thread(target=lambda: [held.append(listener.accept()) for _ in range(64)], daemon=True).start()
    proc = subprocess.run([sys.executable, "-m", "pairclean", "score", str(coco_shards), "--out",
                           str(tmp_path / "s.parquet"), *TINY, "--engine", "ray", "--ray-address",
                           f"127.0.0.1:{listener.getsockname()[1]}"], capture_output=True, text=True, timeout=120)
    listener.close()
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "--ray-address" in lines[0], proc.stderr[-2000:]
    # Ray missing: one line naming the extra (the import fails as it does without the package)
    monkeypatch.setitem(sys.modules, "ray", None)
    code, _, err = run_cli(["score", str(coco_shards), "--out", str(tmp_path / "r.parquet"), *TINY, "--engine", "ray"],
                           capsys)
    assert code == 2 and "pip install 'pairclean[ray]'" in err and len(err.strip().splitlines()) == 1, err
    monkeypatch.undo()
    assert not list(tmp_path.iterdir())  # nothing written
