"""image-label and image-image pairs scored end to end on the toy world, with known mismatches.

1. the toy world's estimator (`pairclean synth train-estimator`: the `pairclean-toy` CLIP-style
   model trained from scratch on clean toy image-text pairs; taken from the cache when an
   identical recipe was trained before) - it has never seen an image-label or image-image pair;
2. pairclean.lab.toy_pairs writes held-out image-label pairs (one shape per image, label = the
   shape's name, and a second set with its colour name) and image-image pairs (two views of one
   scene), a share of them mismatched;
3. each set is scored by `pairclean score --pair image-label|image-image` with that model (the
   label goes through the text tower as "This is a picture of {label}."; both images of an
   image-image pair through the image tower), and measured by `pairclean evaluate detection`.

    python benchmarks/toy_pair_kinds.py --threads 1
    python benchmarks/toy_pair_kinds.py --pairs 500 --noise 0.5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pairclean.ops.atomic import write_json
from pairclean.lab.synth.estimator import CHECKPOINT, TOY_MODEL, EstimatorRecipe, cached_checkpoint
from pairclean.lab.toy_pairs import build_toy_pairs

SETS = (("image-label", "shape"), ("image-label", "colour"), ("image-image", None))


def pairclean(*args: str, threads: int | None = None) -> float:
    started = time.perf_counter()
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    proc = subprocess.run([sys.executable, "-m", "pairclean", *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"pairclean {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    print(proc.stdout.rstrip()[-3000:], flush=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=1000, help="pairs per evaluated set")
    parser.add_argument("--noise", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS of the pairclean processes (on a machine shared "
                                                   "with other jobs, 1 made training steps 4x faster)")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = (args.workdir or Path(tempfile.mkdtemp(prefix="pairclean-toykinds-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)

    checkpoint = cached_checkpoint(EstimatorRecipe())
    train_seconds = 0.0
    if checkpoint is None:
        train_seconds = pairclean("synth", "train-estimator", "--out", str(work / "estimator"), "--overwrite",
                                  threads=args.threads)
        checkpoint = work / "estimator" / CHECKPOINT
    print(f"estimator: {checkpoint}", flush=True)
    results = []
    for kind, label in SETS:
        name = kind + (f"-{label}" if label else "")
        data = work / name
        build_toy_pairs(data, kind, args.pairs, seed=args.seed, noise=args.noise, shard_size=500,
                        label=label or "shape", overwrite=True)
        scores = work / f"scores-{name}.parquet"
        metrics_path = work / f"detection-{name}.json"
        pairclean("score", str(data / "manifest.yaml"), "--out", str(scores), "--overwrite", "--model", TOY_MODEL,
                  "--pretrained", str(checkpoint), "--device", "cpu", "--seed", str(args.seed), threads=args.threads)
        pairclean("evaluate", "detection", str(scores), "--truth", str(data / "manifest.yaml"), "--json", str(metrics_path))
        m = json.loads(metrics_path.read_text())
        rules = m["rules"]
        results.append({"set": name, "pairs": m["pairs"], "noisy": m["noisy"], "roc_auc": m["roc_auc"],
                        "beta": rules["beta"]["threshold"], "beta_clean_kept": rules["beta"]["clean_kept"],
                        "beta_noise_caught": rules["beta"]["noise_caught"],
                        "gmm_balanced_accuracy": rules["gmm"]["balanced_accuracy"],
                        "oracle_balanced_accuracy": rules["oracle"]["balanced_accuracy"]})
    print(f"\nestimator {TOY_MODEL} ({checkpoint}; " + (f"trained now in {train_seconds:.0f} s)" if train_seconds
                                                        else "from the cache)"))
    print("pair kind | pairs (noisy) | ROC-AUC | beta: kept / caught | GMM bal. acc | oracle bal. acc")
    for r in results:
        print(f"{r['set']} | {r['pairs']:,} ({r['noisy']:,}) | {r['roc_auc']:.4f} | {r['beta_clean_kept']:.2f} / "
              f"{r['beta_noise_caught']:.2f} (beta {r['beta']:.4f}) | {r['gmm_balanced_accuracy']:.2f} | "
              f"{r['oracle_balanced_accuracy']:.2f}")
    if args.json:
        write_json(args.json, {"args": {k: str(v) for k, v in vars(args).items()}, "estimator": str(checkpoint),
                               "train_seconds": train_seconds, "results": results})


if __name__ == "__main__":
    main()
