"""Resume and atomicity: SIGKILLed runs continue to the same rows as an uninterrupted run, and no
file ever looks complete when it is not.

Kills are real SIGKILLs (pairclean.ops.faults) of forked children: a fork inherits the imported
torch/open_clip, so a killed run costs a second, not an interpreter start. Every run in the
kill test is forked with one intra-op thread, so reference and resumed runs compute alike.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import signal
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import forked

from pairclean.ops.atomic import atomic_path, is_temp_name, temp_name
from pairclean.errors import UserError
from pairclean.scorefile.contract import run_manifest_path
from pairclean.scoring.model import score
from pairclean.runs import PartStore, parts_dir_for
from pairclean.scorefile.contract import READ_BACK
from pairclean.scoring.parts import NON_FINITE, ScoredUnit, part_table

SETTINGS = {"model": "m", "beta_mode": "random-inputs", "weight_fn": "cubic", "units_sha1": "x", "n_units": 2}


@contextmanager
def held_by_another_process(lock: Path):
    """A child process that holds the run lock until the block ends."""
    read_end, write_end = os.pipe()
    go_read, go_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        fd = os.open(lock, os.O_RDWR)
        fcntl.lockf(fd, fcntl.LOCK_EX)
        os.write(write_end, b"x")
        os.read(go_read, 1)
        os._exit(0)
    os.read(read_end, 1)
    try:
        yield
    finally:
        os.write(go_write, b"x")
        os.waitpid(pid, 0)
        for fd in (read_end, write_end, go_read, go_write):
            os.close(fd)


def rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def visible_files(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if not is_temp_name(p.name)}


def test_sigkilled_runs_resume_to_the_uninterrupted_rows(coco_shards, fast_config, tmp_path):
    ref, out = tmp_path / "ref" / "s.parquet", tmp_path / "run" / "s.parquet"
    ref.parent.mkdir()
    out.parent.mkdir()
    assert forked(lambda: score(str(coco_shards), ref, fast_config)) == 0

    def run():
        score(str(coco_shards), out, fast_config)

    # 1. the second unit's part is in place, its commit record is not: the unit is redone
    assert forked(run, "part-written:2") == -signal.SIGKILL
    assert not out.exists() and len(list(parts_dir_for(out).glob("part-*.done.json"))) == 1
    beta = parts_dir_for(out) / "beta.json"
    beta_written = (beta.read_text(), beta.stat().st_mtime_ns)
    # 2. during finalize, after the first record batch of the output is written
    assert forked(run, "finalize-batch:2") == -signal.SIGKILL
    assert visible_files(out.parent) == {parts_dir_for(out).name}  # no output, no manifest yet
    assert (beta.read_text(), beta.stat().st_mtime_ns) == beta_written  # computed once, reused
    # 3. after the output was renamed into place, before the parts were removed
    assert forked(run, "finalize-renamed:1") == -signal.SIGKILL
    assert out.exists() and parts_dir_for(out).exists()
    finished_once = rows(out)
    # 4. the re-run recognises its own finished output and only cleans up
    assert forked(run) == 0
    assert not parts_dir_for(out).exists()
    assert visible_files(out.parent) == {out.name, run_manifest_path(out).name}
    got, want = rows(out), rows(ref)
    assert got == finished_once
    assert [(r["shard"], r["index"]) for r in got] == [(r["shard"], r["index"]) for r in want]
    assert all(same(g[c], w[c]) for g, w in zip(got, want) for c in w), "values differ from the uninterrupted run"


def test_finished_run_rerun_is_a_no_op_and_other_settings_are_refused(coco_shards, fast_config, tmp_path):
    out = tmp_path / "s.parquet"
    first = score(str(coco_shards), out, fast_config)
    stamp = out.stat().st_mtime_ns
    manifest = json.loads(run_manifest_path(out).read_text())
    assert manifest["summary"]["pairs"] == first.summary.pairs == len(rows(out))
    assert manifest["provenance"]["run_id"] and manifest["provenance"]["settings_sha1"]
    again = score(str(coco_shards), out, replace(fast_config, resume=True))
    assert again.already_complete and again.pairs_scored_now == 0 and again.summary.pairs == first.summary.pairs
    assert out.stat().st_mtime_ns == stamp
    with pytest.raises(UserError, match="other settings.*pass `overwrite`"):
        score(str(coco_shards), out, replace(fast_config, weight_fn="linear"))
    assert out.stat().st_mtime_ns == stamp and not parts_dir_for(out).exists()


def test_a_bf16_run_started_with_autocast_everywhere_is_not_resumed_by_the_stored_weights_way(
        coco_shards, fast_config, tmp_path, monkeypatch):
    """On CUDA the two ways differ within bf16 rounding: one scores file must not hold both."""
    from pairclean.backends.open_clip import OpenClipBackend

    out = tmp_path / "s.parquet"
    bf16 = replace(fast_config, precision="bf16")
    with monkeypatch.context() as earlier:  # what pinned settings held before the towers ran autocast-free
        earlier.setattr(OpenClipBackend, "low_precision", "autocast")
        assert forked(lambda: score(str(coco_shards), out, bf16), "committed:1") == -signal.SIGKILL
    pinned = json.loads((parts_dir_for(out) / "settings.json").read_text())
    assert "low_precision" not in pinned  # autocast: what every earlier pairclean pinned, by saying nothing
    with pytest.raises(UserError, match="low_precision: None -> 'stored'"):
        score(str(coco_shards), out, bf16)
    assert score(str(coco_shards), out, replace(bf16, overwrite=True)).summary.pairs == 16
    estimator = json.loads(pq.read_schema(out).metadata[b"pairclean"])["estimator"]
    assert estimator["precision"] == "bf16" and estimator["autocast"] == {"image": False, "text": False}
    from pairclean.data.dataset import as_dataset
    from pairclean.scoring.model import ModelProducer

    assert "low_precision" not in ModelProducer(as_dataset(str(coco_shards)), fast_config).settings()  # fp32


def test_killed_overwrite_run_resumes_and_replaces_the_output(coco_shards, fast_config, tmp_path):
    out = tmp_path / "s.parquet"
    out.write_bytes(b"an older output")
    code = forked(lambda: score(str(coco_shards), out, replace(fast_config, overwrite=True)), "committed:1")
    assert code == -signal.SIGKILL and out.read_bytes() == b"an older output"
    # The consent to replace was given when the run started: re-running without --overwrite goes on.
    result = score(str(coco_shards), out, fast_config)
    assert result.resumed and result.summary.pairs == 16 and len(rows(out)) == 16


def test_resume_flag_settings_and_lock(tmp_path):
    out = tmp_path / "s.parquet"
    store = PartStore(parts_dir_for(out))
    with pytest.raises(UserError, match="nothing to resume"):
        store.finished(out, SETTINGS, READ_BACK, resume=True)  # refused before any model is loaded
    with pytest.raises(UserError, match="contradict"):
        store.finished(out, SETTINGS, READ_BACK, overwrite=True, resume=True)
    with pytest.raises(UserError, match="nothing to resume"):
        store.begin(out, SETTINGS, ["a.tar", "b.tar"], resume=True)
    with pytest.raises(UserError, match="contradict"):
        store.begin(out, SETTINGS, ["a.tar", "b.tar"], overwrite=True, resume=True)
    assert not store.dir.exists()  # a refused start leaves nothing behind

    assert not store.begin(out, SETTINGS, ["a.tar", "b.tar"]).resumed
    store._unlock()
    with held_by_another_process(store.dir / "lock"):
        with pytest.raises(UserError, match="another pairclean process"):
            PartStore(store.dir).begin(out, SETTINGS, ["a.tar", "b.tar"])

    other = {**SETTINGS, "model": "ViT-L-14", "weight_fn": "linear"}
    with pytest.raises(UserError) as info:
        PartStore(store.dir).begin(out, other, ["a.tar", "b.tar"])
    assert "model: 'm' -> 'ViT-L-14'" in str(info.value) and "weight_fn: 'cubic' -> 'linear'" in str(info.value)

    (store.dir / temp_name(store.dir / "part-x.parquet").name).write_bytes(b"half a part")
    again = PartStore(store.dir)
    assert again.begin(out, SETTINGS, ["a.tar", "b.tar"], resume=True).resumed
    assert not any(is_temp_name(p.name) for p in store.dir.iterdir())  # a killed writer's temp is gone
    again.remove()


def test_resume_keeps_the_pinned_units_when_a_shard_vanished(tmp_path):
    out = tmp_path / "s.parquet"
    shards = [tmp_path / "a.tar", tmp_path / "b.tar"]
    for s in shards:
        s.write_bytes(b"")
    units = [str(s) for s in shards]
    store = PartStore(parts_dir_for(out))
    store.begin(out, SETTINGS, units)
    store._unlock()
    shards[1].unlink()  # listing the directory again no longer finds it
    again = PartStore(store.dir)
    start = again.begin(out, SETTINGS, units[:1])
    assert start.resumed and start.units == units  # read later, b.tar becomes a failed unit
    again._unlock()
    with pytest.raises(UserError, match="1 new"):
        PartStore(store.dir).begin(out, SETTINGS, units + [str(tmp_path / "c.tar")])


def test_commit_counts_rows_and_turns_non_finite_similarities_into_errors(tmp_path):
    out = tmp_path / "s.parquet"
    store = PartStore(parts_dir_for(out), record=ScoredUnit)
    store.begin(out, SETTINGS, ["u"])
    part = part_table({"key": ["a", "b", "c", "d"], "shard": ["u"] * 4, "index": [0, 1, 2, 3],
                       "sim": [0.5, float("nan"), None, float("inf")], "error": [None, None, "bad image", None]})
    store.commit_table("u", part.table, {"failure": None, "errors": part.errors, "null_rows": part.null_rows})
    record = store.committed()["u"]
    assert (record.rows, record.errors, record.null_rows) == (4, 3, 0)
    part = pq.read_table(store.part_path("u")).to_pylist()
    assert [r["error"] for r in part] == [None, NON_FINITE, "bad image", NON_FINITE]
    assert part[1]["sim"] is None
    store.remove()


def test_atomic_writes_never_clobber_and_never_leave_half_files(tmp_path):
    target = tmp_path / "out.parquet"
    with atomic_path(target, no_clobber=True) as tmp:
        tmp.write_bytes(b"first")
        target.write_bytes(b"someone else's file")  # appears while we write
        with pytest.raises(UserError, match="appeared"):
            with atomic_path(target, no_clobber=True) as tmp2:
                tmp2.write_bytes(b"second")
        target.unlink()
    assert target.read_bytes() == b"first"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"partial")
            raise RuntimeError("killed mid-write")
    assert target.read_bytes() == b"first" and visible_files(tmp_path) == {"out.parquet"}
    assert not any(is_temp_name(p.name) for p in tmp_path.iterdir())
    names = {temp_name(target).name for _ in range(50)}
    assert len(names) == 50 and all(f"-{os.getpid()}-" in n and is_temp_name(n) for n in names)


@pytest.mark.slow
def test_fault_injection_benchmark(tmp_path):
    """The full benchmark: at least 20 SIGKILL trials on the toy world, finalize included."""
    import subprocess
    import sys

    bench = Path(__file__).parent.parent / "benchmarks" / "fault_injection.py"
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, str(bench), "--trials", "24", "--pairs", "240", "--shard-size", "30",
                           "--workdir", str(tmp_path / "work"), "--json", str(report)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tally = json.loads(report.read_text())["tally"]
    assert tally["sigkills"] >= 20 and tally["kills_by_phase"].get("finalize", 0) >= 1
    assert (tally["lost"], tally["duplicated"], tally["extra"], tally["value_mismatch"]) == (0, 0, 0, 0)
    assert tally["leftover_files"] == 0 and tally["summaries_reconcile"] and not tally["order_differs"]
