"""pairclean score vs clip-retrieval inference: the same COCO-mini pairs, the same weights, whole commands.

What the peer users would otherwise pick is clip-retrieval (PyPI `clip-retrieval`): it embeds
images and captions and writes no score. Both tools here run ViT-B-32 from one local, randomly
initialised open_clip checkpoint (same FLOPs as the real one; nothing can be downloaded), fp32 on
the CPU, the same batch size and worker count, on the same WebDataset shards of COCO-mini
(239 real JPEGs, first caption each). Each command is timed as a whole (start-up, model load,
everything it writes), and the pairclean runs are reported three ways so that beta's cost is
never hidden:

  pairclean cold    - random-inputs beta computed (K=1024 random images and texts through the model)
  pairclean cached  - the same command again: beta read from the beta cache (it depends on the
                      weights, K and seed only, never on the data)
  pairclean shuffled- --beta-mode shuffled: beta from the scored pairs, no extra forwards

clip-retrieval runs in its own virtual environment (created on first use with
--system-site-packages, so it reuses this machine's torch/torchvision instead of downloading
one; it needs setuptools<81 for pkg_resources).

    python benchmarks/clip_retrieval_compare.py --repeat 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_COCO = REPO.parent / "shared" / "data" / "coco-mini"


def sh(cmd: list[str], env: dict | None = None) -> tuple[float, str]:
    """Run a command, return (wall seconds, combined output); exit on failure."""
    started = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-4000:]}")
    return seconds, proc.stdout


def ensure_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not (venv / "bin" / "clip-retrieval").exists():
        print(f"creating {venv} (clip-retrieval, setuptools<81; torch reused from the system)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "setuptools<81", "clip-retrieval"], check=True)
    _, where = sh([str(python), "-c", "import torch, open_clip, clip_retrieval, importlib.metadata as m; "
                                      "print(torch.__version__, torch.__file__, open_clip.__version__, "
                                      "m.version('clip-retrieval'))"])
    version, torch_file, open_clip_version, cr_version = where.split()[-4:]
    if str(venv) in torch_file:
        print(f"warning: the venv installed its own torch ({torch_file})", flush=True)
    print(f"clip-retrieval {cr_version} (open_clip {open_clip_version}) on torch {version} from {torch_file}", flush=True)
    return venv


def make_data(coco: Path, work: Path, shard_size: int) -> list[Path]:
    from pairclean.lab.coco import build_shards

    shards = work / "shards"
    if not (shards / "manifest.yaml").is_file():
        build_shards(coco, shards, shard_size=shard_size, overwrite=True)
    return sorted(shards.glob("*.tar"))


def make_checkpoint(path: Path) -> Path:
    """ViT-B-32 with random weights (seed 0), as a plain state dict both open_clip versions load."""
    if not path.is_file():
        import open_clip
        import torch

        torch.manual_seed(0)
        model = open_clip.create_model("ViT-B-32", pretrained=None)
        tmp = path.with_suffix(".tmp")
        torch.save(model.state_dict(), tmp)
        tmp.rename(path)
    return path


def run_clip_retrieval(venv: Path, shards: list[Path], ckpt: Path, out: Path, args) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    first, last = shards[0].stem.rsplit("-", 1)[1], shards[-1].stem.rsplit("-", 1)[1]
    pattern = str(shards[0].parent / f"{shards[0].stem.rsplit('-', 1)[0]}-{{{first}..{last}}}.tar")
    seconds, output = sh([str(venv / "bin" / "clip-retrieval"), "inference", "--input_dataset", pattern,
                          "--input_format", "webdataset", "--output_folder", str(out),
                          "--clip_model", f"open_clip:ViT-B-32/{ckpt}", "--batch_size", str(args.batch_size),
                          "--num_prepro_workers", str(args.workers), "--enable_text", "True", "--enable_image", "True",
                          "--enable_metadata", "False", "--use_jit", "False",
                          "--wds_image_key", "jpg", "--wds_caption_key", "txt"])
    _, counts = sh([str(venv / "bin" / "python"), "-c",
                    "import numpy, glob, sys; print(sum(numpy.load(f).shape[0] for f in glob.glob(sys.argv[1])))",
                    str(out / "img_emb" / "*.npy")])
    return {"pairs": int(counts.split()[-1]), "seconds": seconds}


def run_pairclean(shards_dir: Path, ckpt: Path, out: Path, args, cache: Path, beta_mode: str) -> dict:
    env = {**os.environ, "PAIRCLEAN_CACHE_DIR": str(cache)}
    cmd = [sys.executable, "-m", "pairclean", "score", str(shards_dir), "--out", str(out), "--overwrite",
           "--model", "ViT-B-32", "--pretrained", str(ckpt), "--batch-size", str(args.batch_size),
           "--workers", str(args.workers), "--precision", args.precision, "--beta-mode", beta_mode]
    seconds, output = sh(cmd, env=env)
    text = re.sub(r"\s+", " ", output)
    times = re.search(r"time: beta / scoring[ │|]+([\d.]+) s \(([^)]*)\) / ([\d.]+) s", text)
    pairs = re.search(r"scored[ │|]+([\d,]+)", text)
    return {"pairs": int(pairs.group(1).replace(",", "")) if pairs else None, "seconds": seconds,
            "beta_seconds": float(times.group(1)) if times else None, "beta_source": times.group(2) if times else None,
            "scoring_seconds": float(times.group(3)) if times else None}


def rate(r: dict) -> float:
    return r["pairs"] / r["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--coco", type=Path, default=DEFAULT_COCO, help="shared/data/coco-mini")
    parser.add_argument("--venv", type=Path, default=Path("/tmp/pairclean-cr-venv"))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/pairclean-vs-clip-retrieval"))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--precision", default="fp32", help="pairclean's precision (clip-retrieval runs fp32 on CPU)")
    parser.add_argument("--shard-size", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=1, help="rounds of (clip-retrieval, pairclean cached, shuffled)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    args.workdir.mkdir(parents=True, exist_ok=True)
    venv = ensure_venv(args.venv)
    shards = make_data(args.coco, args.workdir, args.shard_size)
    ckpt = make_checkpoint(args.workdir / "vit-b-32-random-seed0.pt")
    cache = args.workdir / "cache"
    shutil.rmtree(cache, ignore_errors=True)  # the first pairclean run computes beta
    load = lambda: f"load {os.getloadavg()[0]:.1f}"  # noqa: E731

    results: dict[str, list[dict]] = {"clip-retrieval": [], "pairclean cold": [], "pairclean cached": [],
                                      "pairclean shuffled": []}
    r = run_pairclean(shards[0].parent, ckpt, args.workdir / "pc.parquet", args, cache, "random-inputs")
    results["pairclean cold"].append(r)
    print(f"pairclean cold     {r['pairs']} pairs {r['seconds']:6.1f} s {rate(r):5.2f} pairs/s "
          f"(beta {r['beta_seconds']} s {r['beta_source']}, scoring {r['scoring_seconds']} s) {load()}", flush=True)
    for i in range(args.repeat):
        r = run_clip_retrieval(venv, shards, ckpt, args.workdir / "cr-out", args)
        results["clip-retrieval"].append(r)
        print(f"[{i + 1}] clip-retrieval {r['pairs']} pairs {r['seconds']:6.1f} s {rate(r):5.2f} pairs/s {load()}", flush=True)
        for name, mode in (("pairclean cached", "random-inputs"), ("pairclean shuffled", "shuffled")):
            r = run_pairclean(shards[0].parent, ckpt, args.workdir / "pc.parquet", args, cache, mode)
            results[name].append(r)
            print(f"[{i + 1}] {name:<18} {r['pairs']} pairs {r['seconds']:6.1f} s {rate(r):5.2f} pairs/s "
                  f"(beta {r['beta_seconds']} s {r['beta_source']}, scoring {r['scoring_seconds']} s) {load()}",
                  flush=True)

    cr = statistics.median(rate(r) for r in results["clip-retrieval"])
    print(f"\nwhole command, pairs/s (median over {args.repeat} round(s)); ratio to clip-retrieval")
    for name, runs in results.items():
        value = statistics.median(rate(r) for r in runs)
        print(f"  {name:<20} {value:6.2f}   x{value / cr:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=2))


if __name__ == "__main__":
    main()
