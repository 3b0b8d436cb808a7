"""One CUDA-only branch of pairclean checked on a few web images, bad ones among them (the first minute
of a device call, `benchmarks/gpu_figures.sh`; each branch in a process of its own under `timeout 20`).

    python benchmarks/cuda_smoke.py BRANCH SHARDS_DIR --device cuda --json OUT.json

Branches (each compares the device's result with the CPU's on the same files):
  decoders  every device decoder that can run here (gpu, gpu-resize, nvimgcodec, dali), fed as the
            workers feed it (`OpenClipPreparer.leaving_to`): its pixels against PIL's Resize + CenterCrop
            (largest difference, share off by more than 1), and its failed rows against the rows PIL
            cannot decode (the same error rows as the CPU path);
  score     `pairclean score` of the shards with the tiny model, `--decode gpu` on the device (the
            prefetching thread, the feed's streams, `HostCopies`), fp32 and bf16, against the CPU's
            `--decode exact` run: the same rows and errors, sims within a tolerance;
  text      the text tower's CUDA path (boolean-mask attention, `causal_blocks`) against the CPU's;
  compile   the tiny model's towers compiled on the device (the eager backend, `fullgraph`, over
            partial batches): still compiled at the end (`compiled_towers`), outputs as eager's;
  train     one epoch of the tiny model with `--decode gpu` (batches decoded in the prefetching
            thread): every loss finite.
With `--device cpu` every branch runs its CPU stand-in (device decoders on the CPU, as the
pipeline-only benchmark runs them): a dry run of the lines, not of CUDA. Prints one JSON line; exit
status 0 when the branch's check holds, 1 when not.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

TINY = "pairclean-tiny"


def shard_images(source: Path) -> list[bytes]:
    """Every image member of the shards, in order (bad ones included)."""
    found = []
    for shard in sorted(source.glob("*.tar")):
        with tarfile.open(shard) as tar:
            found.extend(tar.extractfile(m).read() for m in tar if m.isfile() and m.name.endswith(".jpg"))
    return found


def decoders(args, device: torch.device) -> dict:
    from PIL import Image

    from pairclean.backends.base import prepare_each
    from pairclean.backends.device_jpeg import DEVICE_DECODERS
    from pairclean.backends.inputs import StandardTransform
    from pairclean.backends.open_clip import OpenClipEstimator
    from pairclean.data.decode import DecodeError, decode_image

    est = OpenClipEstimator("ViT-B-32", pretrained="none", device="cpu")
    preprocess, transform = est.preparer.preprocess, est.preparer.transform
    files = shard_images(args.shards)
    reference, cpu_failed = {}, set()
    for row, data in enumerate(files):
        try:
            reference[row] = transform.geometry_pixels(decode_image(data)).permute(2, 0, 1)
        except DecodeError:
            cpu_failed.add(row)
    out = {"images": len(files), "cpu_failed_rows": sorted(cpu_failed)}
    ok = True
    for name, cls in DEVICE_DECODERS.items():
        why = cls.cannot_run(device) if device.type == "cuda" else cls.unavailable()
        if why is not None:
            out[name] = {"skipped": why}
            continue
        started = time.perf_counter()
        preparer = est.preparer.leaving_to(cls)
        items = prepare_each(preparer, "image", files)
        good = [row for row, item in enumerate(items) if not isinstance(item, Exception)]
        batch = preparer.collate("image", [items[row] for row in good]).to(device, non_blocking=True)
        pixels, failed = cls(transform, device, preprocess)(batch)
        failed_rows = {row for row, item in enumerate(items) if isinstance(item, Exception)} | {good[p] for p in failed}
        rows = [row for row in good if good.index(row) not in failed]
        pixels = pixels.cpu()[[good.index(row) for row in rows]]
        difference = (pixels.int() - torch.stack([reference[row] for row in rows]).int()).abs()
        result = {"failed_rows": sorted(failed_rows), "same_failed_rows": failed_rows == cpu_failed,
                  "max_difference": int(difference.max()), "share_over_one": float((difference > 1).float().mean()),
                  "seconds": time.perf_counter() - started}
        # nvJPEG's IDCT is not libjpeg's; DALI resamples in float (docs/benchmarks.md, "Device decoders")
        result["ok"] = result["same_failed_rows"] and result["share_over_one"] <= (0.05 if name == "dali" else 0.01)
        ok = ok and result["ok"]
        out[name] = result
    return {**out, "ok": ok}


def _score(shards: Path, out: Path, device: str, precision: str, decode: str):
    from pairclean.scoring.model import ScoreConfig, score

    cfg = ScoreConfig(model=TINY, pretrained="none", device=device, precision=precision, decode=decode, batch_size=16,
                      workers=2, beta_mode="shuffled", overwrite=True, seed=0)
    score(str(shards), out, cfg)
    import duckdb

    return duckdb.sql(f"SELECT shard, \"index\", error, sim FROM '{out}' ORDER BY shard, \"index\"").fetchall()


def score(args, device: torch.device) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        reference = _score(args.shards, Path(tmp) / "cpu.parquet", "cpu", "fp32", "exact")
        out, ok = {}, True
        # loose: the CPU dry run (fast against exact) gave 0.015; it is there for rows out of place or
        # images overwritten before their resize, not for rounding
        for precision, tolerance in (("fp32", 0.05), ("bf16", 0.08)):
            got = _score(args.shards, Path(tmp) / f"{precision}.parquet", str(device), precision, "gpu")
            same_rows = [(r[0], r[1], r[2]) for r in got] == [(r[0], r[1], r[2]) for r in reference]
            worst = max((abs(a[3] - b[3]) for a, b in zip(got, reference) if a[3] is not None and b[3] is not None),
                        default=0.0)
            out[precision] = {"rows": len(got), "errors": sum(r[2] is not None for r in got), "same_rows_and_errors": same_rows,
                              "max_sim_difference": worst, "ok": same_rows and worst <= tolerance}
            ok = ok and out[precision]["ok"]
    return {**out, "ok": ok}


def text(args, device: torch.device) -> dict:
    from pairclean.backends import text_trim
    from pairclean.backends.open_clip import OpenClipEstimator

    if device.type != "cuda":
        text_trim.FUSED_DEVICES = ("cpu",)  # the CUDA path, run by the CPU
    captions = ["a dog on a beach", "two people riding horses along a beach at sunset", "x", "a red car"] * 8
    torch.manual_seed(0)
    cpu = OpenClipEstimator(TINY, pretrained="none", device="cpu")
    torch.manual_seed(0)
    dev = OpenClipEstimator(TINY, pretrained="none", device=str(device))
    calls, blocks = [], text_trim.causal_blocks
    text_trim.causal_blocks = lambda *a: calls.append(1) or blocks(*a)
    tokens = cpu.preparer.collate("text", captions)
    got = dev.encode("text", tokens).cpu()
    text_trim.FUSED_DEVICES = ("cuda",)
    want = cpu.encode("text", tokens)
    worst = float((got - want).abs().max())
    return {"fused_calls": len(calls), "max_difference": worst, "ok": bool(calls) and worst <= 1e-3}


def compile_(args, device: torch.device) -> dict:
    from pairclean.backends.oom import take_rows
    from pairclean.backends.open_clip import OpenClipEstimator

    real = torch.compile
    torch.compile = lambda fn, **kw: real(fn, **{**{k: v for k, v in kw.items() if k != "mode"}, "backend": "eager",
                                                 "fullgraph": True})
    torch.manual_seed(0)
    est = OpenClipEstimator(TINY, pretrained="none", device=str(device), compile=True)
    torch.manual_seed(0)
    eager = OpenClipEstimator(TINY, pretrained="none", device=str(device))
    pixels = torch.randint(0, 256, (8, 3, est.image_size, est.image_size), dtype=torch.uint8)
    tokens = est.preparer.collate("text", ["a dog", "two people riding horses along a beach", "x", "a cup"] * 2)
    worst = 0.0
    for rows in (8, 5, 8):
        worst = max(worst, float((est.encode("image", pixels[:rows]) - eager.encode("image", pixels[:rows])).abs().max()))
        part = take_rows(tokens, slice(0, rows))
        worst = max(worst, float((est.encode("text", part) - eager.encode("text", part)).abs().max()))
    state = est.compiled_towers()
    return {"compiled_towers": state, "max_difference": worst,
            "ok": state == {"image": "compiled", "text": "compiled"} and worst <= 1e-3}


def train(args, device: torch.device) -> dict:
    import math

    from pairclean.training.logs import read_metrics
    from pairclean.training.trainer import TrainConfig, train as train_run

    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(model=TINY, pretrained="none", device=str(device), decode="gpu", batch_size=16, workers=2,
                          epochs=1, lr=1e-4, warmup_steps=1, seed=0, log_every=1)
        result = train_run(str(args.shards), Path(tmp) / "run", cfg)
        losses = [r["loss"] for r in read_metrics(Path(tmp) / "run" / "metrics.jsonl") if r["event"] == "step"]
    return {"steps": result.epochs[0]["steps"], "pairs": result.epochs[0]["pairs"], "losses": losses,
            "ok": bool(losses) and all(math.isfinite(x) for x in losses)}


BRANCHES = {"decoders": decoders, "score": score, "text": text, "compile": compile_, "train": train}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("branch", choices=sorted(BRANCHES))
    parser.add_argument("shards", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        result = {"skipped": "no CUDA device", "ok": None}
    else:
        started = time.perf_counter()
        result = BRANCHES[args.branch](args, device)
        result["seconds"] = time.perf_counter() - started
    result = {"branch": args.branch, "device": str(device), **result}
    line = json.dumps(result, default=str)
    print(line)
    if args.json:
        args.json.write_text(line + "\n")
    sys.exit(0 if result["ok"] in (True, None) else 1)


if __name__ == "__main__":
    main()
