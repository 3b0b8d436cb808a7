"""What `pairclean score --save-embeddings` costs: the same scoring run with and without it, in
one process, alternating, and the bytes it writes per pair.

Per model, the toy world is scored `--repeat` times each way (fresh output each time; beta from
the cache, so every run does the same work): the scoring loop's seconds and its process CPU
seconds (decode, encode, commit, and with saving the unit's block written before its commit; the
CPU figure moves less on a shared machine) and the whole call's. Two models:
the demo's toy estimator (`pairclean-toy`, 64-d embeddings: a fast model, so the saving's share
is large) and ViT-B-32 with random weights (512-d, as CLIP ViT-B/32 writes them; `--pretrained
none`: the same compute as the real weights).

    python benchmarks/save_embeddings_cost.py                 # toy 4,000 pairs, ViT-B-32 200 pairs, 3 rounds
    python benchmarks/save_embeddings_cost.py --toy-pairs 1000 --vit-pairs 0 --repeat 1
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from pairclean.lab.synth.estimator import TOY_MODEL, EstimatorRecipe, cached_checkpoint, train_estimator
from pairclean.lab.synth.world import build_world
from pairclean.ops.atomic import write_json
from pairclean.scoring.model import ScoreConfig, score


def one_run(world: Path, work: Path, cfg: ScoreConfig, save: bool) -> dict:
    out, emb = work / "scores.parquet", work / "emb"
    for path in (out, emb):
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    started = time.perf_counter()
    result = score(str(world), out, ScoreConfig(**{**cfg.__dict__, "save_embeddings": str(emb) if save else None}))
    wall = time.perf_counter() - started
    s = result.summary
    return {"scoring_seconds": s.scoring_seconds, "scoring_cpu_seconds": s.scoring_cpu_seconds,
            "wall_seconds": wall, "pairs": s.pairs, "embedding_bytes": s.embedding_bytes,
            "embeddings_saved": s.embeddings_saved}


def measure(name: str, world: Path, work: Path, cfg: ScoreConfig, repeat: int) -> dict:
    runs = {False: [], True: []}
    for round_ in range(repeat):
        for save in (False, True):
            runs[save].append(one_run(world, work, cfg, save))
            r = runs[save][-1]
            print(f"  {name} round {round_ + 1} {'with   ' if save else 'without'} --save-embeddings: "
                  f"scoring {r['scoring_seconds']:.2f} s ({r['scoring_cpu_seconds']:.2f} CPU s), whole call "
                  f"{r['wall_seconds']:.2f} s", flush=True)
    median = {save: {k: statistics.median(r[k] for r in rs) for k in ("scoring_seconds", "scoring_cpu_seconds",
                                                                       "wall_seconds")}
              for save, rs in runs.items()}
    saved = runs[True][-1]
    return {"model": name, "pairs": saved["pairs"], "rounds": repeat, "runs": {str(k): v for k, v in runs.items()},
            "scoring_ratio": median[True]["scoring_seconds"] / median[False]["scoring_seconds"],
            "cpu_ratio": median[True]["scoring_cpu_seconds"] / median[False]["scoring_cpu_seconds"],
            "wall_ratio": median[True]["wall_seconds"] / median[False]["wall_seconds"],
            "median": {str(k): v for k, v in median.items()},
            "bytes_per_pair": saved["embedding_bytes"] / saved["embeddings_saved"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--toy-pairs", type=int, default=4000)
    parser.add_argument("--vit-pairs", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="save-embeddings-cost-"))
    results = []
    if args.toy_pairs:
        estimator = cached_checkpoint(EstimatorRecipe()) or train_estimator(work / "estimator", EstimatorRecipe())
        build_world(work / "toy", args.toy_pairs, seed=0, overwrite=True)
        (work / "toy-runs").mkdir(exist_ok=True)
        results.append(measure("pairclean-toy (64-d)", work / "toy", work / "toy-runs",
                               ScoreConfig(model=TOY_MODEL, pretrained=str(estimator), workers=args.workers), args.repeat))
    if args.vit_pairs:
        build_world(work / "vit", args.vit_pairs, seed=0, overwrite=True)
        (work / "vit-runs").mkdir(exist_ok=True)
        results.append(measure("ViT-B-32 (512-d, random weights)", work / "vit", work / "vit-runs",
                               ScoreConfig(model="ViT-B-32", pretrained="none", workers=args.workers, batch_size=64,
                                           beta_mode="fixed", beta=0.2),  # beta's 2 x 1,024 forward passes: not measured
                               args.repeat))
    print("\n| model | pairs | scoring loop: without / with (s, median) | ratio | CPU s ratio | whole call ratio "
          "| bytes per pair |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['pairs']:,} | {r['median']['False']['scoring_seconds']:.2f} / "
              f"{r['median']['True']['scoring_seconds']:.2f} | {r['scoring_ratio']:.3f} | {r['cpu_ratio']:.3f} | "
              f"{r['wall_ratio']:.3f} | {r['bytes_per_pair']:,.0f} |")
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
