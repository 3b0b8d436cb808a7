"""SIGKILL `pairclean score` at random points on the toy world, resume it, and compare the final
Parquet with an uninterrupted run: rows lost, rows duplicated, values that differ.

Every run is a separate `pairclean score` process (DataLoader workers included). A trial kills
its first run at one point and, half of the time, its first resume at another, then re-runs the
same command until it exits 0. The kill points cycle through:

    timer             SIGKILL from outside, a random time after the run pinned its settings
    part-written:k    the k-th unit's part is in place, its commit record is not
    committed:k       right after the k-th commit record
    before-rename:k   the k-th atomic write is complete under its temp name, not yet renamed
                      (settings, units, beta, groups, parts, records, run manifest, the output itself)
    finalize-batch:k  after the k-th record batch of the output temp file
    finalize-renamed:1  the output is in place, the parts directory not yet removed

(`PAIRCLEAN_FAULT=NAME:K` makes the process SIGKILL itself there; see pairclean/ops/faults.py.)
After a kill the benchmark notes what the process left on disk (committed parts, temp files,
output); after the trial it checks that no parts directory or temp file is left.

Each run is the CLI's `main()` in a forked child of this script (no interpreter start and torch
import per run); `--spawn` runs `python -m pairclean score` as a fresh process instead.

With `--save-embeddings` every run also writes its embeddings (`score --save-embeddings DIR`),
and each trial's directory is compared with the uninterrupted run's the same way: embeddings
lost, written twice, extra, or with other values, and temp files left in it.

With `--damage`, after every kill one committed part is also damaged before the run resumes, as
a disk, a copy or a hand might: cut short (its last 100 bytes gone), replaced by another unit's
part, or its commit record's row count off by one. The resumed run must score that unit again
(`runs.store.PartStore.verified`) and still give the uninterrupted rows, none lost or twice.

    python benchmarks/fault_injection.py --trials 24 [--spawn] [--save-embeddings] [--damage]
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from pairclean.ops.atomic import is_temp_name
from pairclean.cli import main as main_cli
from pairclean.scorefile.contract import run_manifest_path
from pairclean.runs import parts_dir_for
from pairclean.lab.synth.world import build_world

MODES = ("timer", "part-written", "committed", "before-rename", "finalize-batch", "finalize-renamed")


def score_argv(world: Path, out: Path, args) -> list[str]:
    # --no-beta-cache: every fresh run computes beta, so the resumed runs really use beta.json
    return ["score", str(world), "--out", str(out), "--model", "pairclean-tiny", "--pretrained", "none",
            "--beta-k", str(args.beta_k), "--batch-size", str(args.batch_size), "--workers", str(args.workers),
            "--seed", "0", "--no-beta-cache", *(["--save-embeddings", str(embeddings_dir(out))] if args.save_embeddings
                                                else [])]


def embeddings_dir(out: Path) -> Path:
    return out.parent / "embeddings"


def saved_embeddings(directory: Path) -> tuple[dict, int]:
    """((shard, index) -> (left bytes, right bytes, key), rows seen more than once) of a saved directory."""
    found, repeated = {}, 0
    for meta in sorted((directory / "metadata").glob("metadata_*.parquet")):
        number = meta.stem.split("_")[1]
        left = np.load(directory / "img_emb" / f"img_emb_{number}.npy")
        right = np.load(directory / "text_emb" / f"text_emb_{number}.npy")
        for row, l, r in zip(pq.read_table(meta).to_pylist(), left, right):
            ident = (row["shard"], row["index"])
            repeated += ident in found
            found[ident] = (l.tobytes(), r.tobytes(), row["key"])
    return found, repeated


def compare_embeddings(reference: Path, got: Path) -> dict:
    want, _ = saved_embeddings(reference)
    seen, repeated = saved_embeddings(got)
    return {"embeddings_lost": len(set(want) - set(seen)), "embeddings_duplicated": repeated,
            "embeddings_extra": len(set(seen) - set(want)),
            "embeddings_mismatch": sum(1 for k, v in seen.items() if k in want and v != want[k]),
            "embeddings_complete": (got / "provenance.json").is_file() and not (got / "unfinished.json").exists()}


class ForkedCli:
    """`pairclean <argv>` in a forked child of this process: the CLI's own code path (DataLoader
    workers included) without paying an interpreter start and the torch import per run. This
    process never runs torch itself, so the child starts with a clean OpenMP state."""

    def __init__(self, argv: list[str], env: dict, log: Path):
        self.returncode = None
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.environ.clear()
                os.environ.update(env)
                main_cli(argv)
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:  # noqa: BLE001 - reported in the log, then the child leaves
                traceback.print_exc()
            finally:
                os._exit(code)

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self):
        os.kill(self.pid, signal.SIGKILL)

    def wait(self):
        while self.poll() is None:
            time.sleep(0.005)
        return self.returncode


class SpawnedCli(ForkedCli):
    """`python -m pairclean <argv>` as a fresh process (--spawn): exactly what a user runs."""

    def __init__(self, argv: list[str], env: dict, log: Path):
        with open(log, "w") as fh:
            self.proc = subprocess.Popen([sys.executable, "-m", "pairclean", *argv], env=env, stdout=fh, stderr=fh)
        self.returncode = None

    def poll(self):
        self.returncode = self.proc.poll()
        return self.returncode

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)


def run(argv: list[str], out: Path, args, fault: str | None = None, kill_after: float | None = None
        ) -> tuple[int, float | None]:
    """One scoring run; returns (exit status or -signal, seconds from its settings being pinned to its exit)."""
    env = {k: v for k, v in os.environ.items() if k != "PAIRCLEAN_FAULT"}
    if fault:
        env["PAIRCLEAN_FAULT"] = fault
    log = out.parent / "last-run.log"
    proc = (SpawnedCli if args.spawn else ForkedCli)(argv, env, log)
    settings = parts_dir_for(out) / "settings.json"
    pinned = None
    while proc.poll() is None:
        if pinned is None and settings.exists():
            pinned = time.perf_counter()
        if pinned is not None and kill_after is not None and time.perf_counter() - pinned >= kill_after:
            proc.kill()
            proc.wait()
            break
        time.sleep(0.005)
    if proc.returncode not in (0, -signal.SIGKILL):
        raise SystemExit(f"pairclean score failed ({proc.returncode}): {log.read_text()[-2000:]}")
    return proc.returncode, (time.perf_counter() - pinned) if pinned is not None else None


def left_on_disk(out: Path, n_units: int) -> tuple[str, str]:
    """The phase a killed run was in, judged from what it left: (phase, detail)."""
    parts = parts_dir_for(out)
    if not (parts / "settings.json").exists():
        return "starting", "settings not pinned yet"
    committed = len(list(parts.glob("part-*.done.json")))
    temps = sorted(p.name.split(".tmp-")[0].lstrip(".") for d in (parts, out.parent) for p in d.iterdir()
                   if is_temp_name(p.name))
    detail = f"{committed}/{n_units} units committed" + (f"; temp: {', '.join(temps)}" if temps else "")
    if out.exists():
        return "after rename", "output in place, parts not yet removed"
    if out.name in temps or committed == n_units:
        return "finalize", detail
    return "scoring", detail


DAMAGES = ("truncated", "swapped", "miscounted")


def damage(out: Path, rng: random.Random) -> str | None:
    """Damage one committed part of the killed run writing `out` (None: nothing committed to damage)."""
    parts = parts_dir_for(out)
    records = sorted(parts.glob("part-*.done.json")) if parts.is_dir() else []
    if not records:
        return None
    record = rng.choice(records)
    part = record.with_name(record.name.replace(".done.json", ".parquet"))
    others = [p for p in parts.glob("part-*.parquet") if p != part]
    how = rng.choice([d for d in DAMAGES if d != "swapped" or others])
    if how == "truncated":
        part.write_bytes(part.read_bytes()[:-100])
    elif how == "swapped":
        shutil.copyfile(rng.choice(others), part)
    else:
        value = json.loads(record.read_text())
        record.write_text(json.dumps({**value, "rows": value["rows"] + rng.choice((-1, 1))}))
    return how


def fault_for(mode: str, rng: random.Random, n_units: int, saving: bool = False) -> str | None:
    if mode == "timer":
        return None
    if mode == "finalize-renamed":
        return "finalize-renamed:1"
    if mode == "before-rename":  # units, run, settings, beta, groups .json, 2 per unit, manifest, output
        # (saving embeddings: 3 more per unit, the block's files, and provenance.json)
        return f"before-rename:{rng.randint(1, 5 + (5 if saving else 2) * n_units + 2 + saving)}"
    return f"{mode}:{rng.randint(1, n_units)}"


def compare(reference: list[dict], got: list[dict]) -> dict:
    """Rows lost / duplicated / extra and values that differ, rows identified by (shard, index)."""
    def ident(r):
        return r["shard"], r["index"]

    want = {ident(r): r for r in reference}
    counts = collections.Counter(ident(r) for r in got)
    seen = {ident(r): r for r in got}

    def same(a, b):
        return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))

    mismatched = sum(1 for k, r in seen.items() if k in want and not all(same(r[c], want[k][c]) for c in r))
    return {"lost": len(set(want) - set(seen)), "duplicated": sum(n - 1 for n in counts.values() if n > 1),
            "extra": len(set(seen) - set(want)), "value_mismatch": mismatched,
            "order_differs": [ident(r) for r in got] != [ident(r) for r in reference]}


def leftovers(out: Path) -> list[str]:
    found = [p.name for p in out.parent.iterdir() if is_temp_name(p.name)]
    if embeddings_dir(out).exists():
        found += [p.name for p in embeddings_dir(out).rglob("*") if is_temp_name(p.name)]
    if parts_dir_for(out).exists():
        found.append(parts_dir_for(out).name)
    return found


def trial(i: int, mode: str, rng: random.Random, world: Path, work: Path, n_units: int, after_pin: float,
          reference: list[dict], args) -> dict:
    out = work / f"trial-{i:03d}" / "scores.parquet"
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = score_argv(world, out, args)
    kills, runs, missed = [], 0, 0
    plan = [mode] + ([rng.choice(MODES)] if rng.random() < 0.5 else [])
    while True:
        runs += 1
        if runs > 8:
            raise SystemExit(f"trial {i}: no clean finish after 8 runs")
        step = plan.pop(0) if plan else None
        fault = fault_for(step, rng, n_units, args.save_embeddings) if step else None
        kill_after = rng.uniform(0.0, 0.9 * after_pin) if step == "timer" else None
        code, _ = run(argv, out, args, fault=fault, kill_after=kill_after)
        if code == 0:
            if step == "timer":
                missed += 1  # the run finished before its timer fired
            break
        phase, detail = left_on_disk(out, n_units)
        kills.append({"point": fault or f"timer:{kill_after:.2f}s", "phase": phase, "left": detail,
                      **({"damaged": damage(out, rng)} if args.damage else {})})
    got = pq.read_table(out).to_pylist()
    summary = json.loads(run_manifest_path(out).read_text())["summary"]
    result = compare(reference, got)
    if args.save_embeddings:
        result.update(compare_embeddings(embeddings_dir(work / "reference" / "scores.parquet"), embeddings_dir(out)))
    result.update({"trial": i, "mode": mode, "runs": runs, "kills": kills, "timer_missed": missed,
                   "leftovers": leftovers(out),
                   "summary_reconciles": summary["pairs"] == len(got) == summary["scored"] + summary["errors"]})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--pairs", type=int, default=480)
    parser.add_argument("--shard-size", type=int, default=40)
    parser.add_argument("--beta-k", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    parser.add_argument("--spawn", action="store_true", help="a fresh interpreter per run instead of a fork")
    parser.add_argument("--save-embeddings", action="store_true", help="every run also saves its embeddings; "
                        "compare each trial's directory with the uninterrupted run's")
    parser.add_argument("--damage", action="store_true", help="after each kill, damage one committed part "
                                                               "(cut short, swapped, miscounted) before resuming")
    parser.add_argument("--workdir", type=Path, default=None, help="kept if given; a temp dir otherwise")
    parser.add_argument("--json", type=Path, default=None, help="write every trial's result here")
    args = parser.parse_args()

    if not args.spawn:  # import once here what every forked run would otherwise import again
        import open_clip  # noqa: F401

        from pairclean.cli import _register_commands

        _register_commands()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="pairclean-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    world = work / "toy-world"
    if not (world / "manifest.yaml").exists():
        build_world(world, pairs=args.pairs, seed=0, shard_size=args.shard_size)
    n_units = len(list(world.glob("*.tar")))
    started = time.perf_counter()
    ref = work / "reference" / "scores.parquet"
    ref.parent.mkdir(exist_ok=True)
    if ref.exists():
        ref.unlink()
    shutil.rmtree(embeddings_dir(ref), ignore_errors=True)
    code, after_pin = run(score_argv(world, ref, args), ref, args)
    reference = pq.read_table(ref).to_pylist()
    print(f"toy world: {len(reference)} pairs in {n_units} shards; uninterrupted run: {after_pin:.1f} s after "
          f"its settings were pinned", flush=True)

    rng = random.Random(args.seed)
    results = []
    for i in range(args.trials):
        mode = MODES[i % len(MODES)]
        r = trial(i, mode, rng, world, work, n_units, after_pin, reference, args)
        results.append(r)
        flags = [k for k in ("lost", "duplicated", "extra", "value_mismatch", "embeddings_lost", "embeddings_duplicated",
                             "embeddings_extra", "embeddings_mismatch") if r.get(k)]
        if args.save_embeddings and not r["embeddings_complete"]:
            flags.append("embeddings_incomplete")
        print(f"trial {i:2d} {mode:17s} runs={r['runs']} kills: "
              + " | ".join(f"{k['point']} -> {k['phase']} ({k['left']})"
                           + (f", then {k['damaged']}" if k.get("damaged") else "") for k in r["kills"])
              + (f"  PROBLEMS: {flags}" if flags or r["leftovers"] or r["order_differs"] else ""), flush=True)

    kills = [k for r in results for k in r["kills"]]
    tally = {
        "trials": len(results), "runs": sum(r["runs"] for r in results), "sigkills": len(kills),
        "kills_by_point": dict(collections.Counter(k["point"].split(":")[0] for k in kills)),
        "kills_by_phase": dict(collections.Counter(k["phase"] for k in kills)),
        "parts_damaged": dict(collections.Counter(k["damaged"] for k in kills if k.get("damaged"))),
        "timer_kills_missed": sum(r["timer_missed"] for r in results),
        "rows_per_run": len(reference),
        "lost": sum(r["lost"] for r in results), "duplicated": sum(r["duplicated"] for r in results),
        "extra": sum(r["extra"] for r in results), "value_mismatch": sum(r["value_mismatch"] for r in results),
        "order_differs": sum(r["order_differs"] for r in results),
        "leftover_files": sum(len(r["leftovers"]) for r in results),
        "summaries_reconcile": all(r["summary_reconciles"] for r in results),
        **({name: sum(r[name] for r in results) for name in ("embeddings_lost", "embeddings_duplicated",
                                                             "embeddings_extra", "embeddings_mismatch")}
           if args.save_embeddings else {}),
        **({"embeddings_complete": all(r["embeddings_complete"] for r in results)} if args.save_embeddings else {}),
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(tally, indent=2))
    if args.json:
        args.json.write_text(json.dumps({"tally": tally, "trials": results}, indent=2, default=str))
    bad = tally["lost"] or tally["duplicated"] or tally["extra"] or tally["value_mismatch"] or tally["leftover_files"] \
        or any(tally.get(k) for k in ("embeddings_lost", "embeddings_duplicated", "embeddings_extra",
                                      "embeddings_mismatch")) or tally.get("embeddings_complete") is False
    sys.exit(1 if bad or not tally["summaries_reconcile"] or tally["order_differs"] else 0)


if __name__ == "__main__":
    main()
