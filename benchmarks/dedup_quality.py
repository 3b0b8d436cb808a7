"""Dedup quality against planted truth, and "keep the cleanest copy" against SemDeDup's choice.

Three experiments, every step the library call behind the command named (the CLI is a thin
layer over them), in one process:

toy    `synth toy-world --pairs 2000 --other-captions 3`; `corrupt --mode duplicate --ratio 0.2`
       (400 copies: 80 exact, 80 re-encoded, 80 resized, 80 cropped, 80 with another wording of
       the caption); `score --model pairclean-toy --pretrained <the demo's cached estimator>
       --save-embeddings`; `dedup --side image|text|both` at the default threshold and a sweep;
       `evaluate dedup`. The truth gets a `content` column (the scene's objects, from its json
       member): two scenes with the same objects are duplicates too (`same content`).
coco   COCO val2017 captions as text-text pairs (one per image: first and second caption),
       `corrupt --mode duplicate --ratio 0.2` (exact copies, and the same image's two other
       captions: a semantic duplicate), `score --backend sentence-transformers --model
       all-MiniLM-L6-v2 --save-embeddings`, then the same sweep (image side = the first text).
clean  the toy duplicates of `toy`, then `corrupt --mode shuffle --ratio 0.3` over all pairs
       (originals and copies alike), scored and deduplicated on the image side with `--keep
       cleanest`, `semdedup` and `random`: the share of noisy captions among the copies kept.

    python benchmarks/dedup_quality.py                       # all three (about 5 min on 2 busy cores)
    python benchmarks/dedup_quality.py --only toy --json out.json --workdir /tmp/dq
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pairclean.data.dataset import open_dataset
from pairclean.data.reading.tar import read_samples
from pairclean.data.spec import raise_failure
from pairclean.dedup import DedupConfig, dedup
from pairclean.dedup.evaluation import evaluate_dedup
from pairclean.dedup.run import DEFAULT_THRESHOLD
from pairclean.lab.coco_text import OTHER_CAPTIONS as COCO_OTHERS, build_text_pairs
from pairclean.calibrate.corrupt import corrupt
from pairclean.calibrate.duplicates import plant_duplicates
from pairclean.lab.synth.estimator import TOY_MODEL, EstimatorRecipe, cached_checkpoint, train_estimator
from pairclean.lab.synth.world import OTHER_CAPTIONS, build_world
from pairclean.ops.atomic import write_json
from pairclean.scoring.model import ScoreConfig, score

REPO = Path(__file__).resolve().parents[1]
CAPTIONS = REPO.parent / "shared" / "data" / "coco-captions" / "captions_val2017.json"
SIDES = ("image", "text", "both")
TOY_SWEEP = (0.9, 0.95, 0.98, 0.99, 0.995, 0.998, 0.999)
COCO_SWEEP = (0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.99)
KINDS = ("exact", "reencode", "resize", "crop", "caption", "identical", "same content")


def step(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def with_scene_content(truth: Path, dataset: Path) -> Path:
    """The truth plus `content`: a hash of each toy scene's objects (its json member)."""
    content = {}
    for shard in open_dataset(str(dataset)).spec.shards:
        for sample in read_samples(shard, raise_failure):
            content[(os.path.basename(shard), sample.index)] = hashlib.sha1(sample.members["json"]).hexdigest()
    table = pq.read_table(truth)
    column = [content[(os.path.basename(s), i)] for s, i in zip(table.column("shard").to_pylist(),
                                                                 table.column("index").to_pylist())]
    out = truth.with_name("truth-with-content.parquet")
    pq.write_table(table.append_column("content", pa.array(column, pa.string())), out)
    return out


def toy_estimator() -> Path:
    checkpoint = cached_checkpoint(EstimatorRecipe())
    if checkpoint is None:
        step("no cached toy estimator: training it (what `pairclean demo` does once)")
        checkpoint = train_estimator(Path(tempfile.mkdtemp(prefix="toy-estimator-")), EstimatorRecipe())
    return checkpoint


def sweep(emb: Path, scores: Path, truth: Path, out: Path, thresholds, sides=SIDES) -> dict:
    """Per side: dedup + evaluate at the default threshold and every sweep threshold."""
    results = {}
    for side in sides:
        for threshold in sorted({DEFAULT_THRESHOLD, *thresholds}):
            target = out / f"dedup-{side}-{threshold}.parquet"
            run = dedup(str(emb), target, scores, DedupConfig(side=side, threshold=threshold, threads=1, overwrite=True))
            metrics = evaluate_dedup(target, truth, side=side)
            results[f"{side}:{threshold}"] = {**metrics.to_json(), "seconds": run.summary.seconds}
            print(f"  {side:<5} > {threshold:<6} precision {fmt(metrics.precision)}  recall {fmt(metrics.recall)}  "
                  + "  ".join(f"{k} {fmt(m.recall)}" for k, m in metrics.kinds.items()), flush=True)
    return results


def fmt(value) -> str:
    return "  n/a" if value is None else f"{value:6.2f}"


def table(results: dict, side: str, kinds=KINDS) -> str:
    """Markdown: one row per threshold, recall per kind, then precision and recall over all pairs."""
    present = [k for k in kinds if any(k in m["kinds"] for key, m in results.items() if key.startswith(side + ":"))]
    lines = [f"| threshold | {' | '.join(f'{k} recall' for k in present)} | precision | recall | removed |",
             "|---" * (len(present) + 4) + "|"]
    for key, m in sorted(results.items(), key=lambda kv: float(kv[0].split(":")[1])):
        if not key.startswith(side + ":"):
            continue
        threshold = key.split(":")[1] + (" (default)" if float(key.split(":")[1]) == DEFAULT_THRESHOLD else "")
        cells = [fmt(m["kinds"][k]["recall"]).strip() if k in m["kinds"] else "-" for k in present]
        lines.append(f"| {threshold} | {' | '.join(cells)} | {fmt(m['precision']).strip()} | {fmt(m['recall']).strip()} "
                     f"| {m['removed']:,} |")
    return "\n".join(lines)


def precision_table(results: dict, side: str, threshold: float) -> str:
    m = results[f"{side}:{threshold}"]
    lines = ["| kind | true pairs | found | recall % | precision % |", "|---|---|---|---|---|"]
    for kind, k in m["kinds"].items():
        lines.append(f"| {kind} | {k['true_pairs']:,} | {k['found']:,} | {fmt(k['recall']).strip()} | "
                     f"{fmt(k['precision']).strip()} |")
    lines.append(f"| all | {m['true_pairs']:,} | {m['found_pairs']:,} | {fmt(m['recall']).strip()} | "
                 f"{fmt(m['precision']).strip()} |")
    return "\n".join(lines)


def toy(work: Path, pairs: int) -> tuple[dict, Path, Path, Path]:
    estimator = toy_estimator()
    step(f"toy world: {pairs:,} pairs + duplicates; estimator {estimator}")
    build_world(work / "world", pairs, seed=0, other_captions=3, overwrite=True)
    planted = plant_duplicates(str(work / "world"), work / "dup", 0.2, seed=0,
                               other_captions=work / "world" / OTHER_CAPTIONS, overwrite=True)
    truth = with_scene_content(planted.truth, work / "dup")
    step("scoring with the toy estimator, saving the embeddings")
    score(str(work / "dup"), work / "scores.parquet",
          ScoreConfig(model=TOY_MODEL, pretrained=str(estimator), workers=1, overwrite=True,
                      save_embeddings=str(work / "emb")))
    step("dedup sweep")
    return sweep(work / "emb", work / "scores.parquet", truth, work, TOY_SWEEP), work / "dup", planted.truth, estimator


def coco(work: Path, limit: int | None) -> dict:
    step("COCO captions as text-text pairs + duplicates (exact, and two other captions of the same image)")
    build_text_pairs(CAPTIONS, work / "pairs", limit=limit, overwrite=True)
    planted = plant_duplicates(str(work / "pairs"), work / "dup", 0.2, seed=0,
                               other_captions=work / "pairs" / COCO_OTHERS, overwrite=True)
    step("scoring with all-MiniLM-L6-v2, saving the embeddings")
    score(str(work / "dup"), work / "scores.parquet",
          ScoreConfig(backend="sentence-transformers", model="all-MiniLM-L6-v2", pretrained="none", workers=1,
                      overwrite=True, save_embeddings=str(work / "emb")))
    step("dedup sweep")
    return sweep(work / "emb", work / "scores.parquet", planted.truth, work, COCO_SWEEP)


def cleanest(work: Path, duplicated: Path, truth: Path, estimator: Path, threshold: float) -> dict:
    step("shuffling 30% of the captions of the duplicated toy world, scoring")
    noisy = corrupt(str(duplicated), work / "noisy", 0.3, seed=1, mode="shuffle", overwrite=True)
    score(str(work / "noisy"), work / "scores.parquet",
          ScoreConfig(model=TOY_MODEL, pretrained=str(estimator), workers=1, overwrite=True,
                      save_embeddings=str(work / "emb")))
    results = {}
    for keep in ("cleanest", "semdedup", "random"):
        target = work / f"dedup-{keep}.parquet"
        dedup(str(work / "emb"), target, work / "scores.parquet",
              DedupConfig(side="image", threshold=threshold, keep=keep, threads=1, overwrite=True))
        m = evaluate_dedup(target, truth, noise_truth=noisy.truth, side="image")
        results[keep] = m.to_json()
        print(f"  keep {keep:<9} planted groups found {m.planted_groups_found}, one kept {m.planted_groups_one_kept}: "
              f"kept copy noisy {fmt(m.kept_noisy_share)}% (of all their copies: {fmt(m.noisy_share_in_groups)}%)",
              flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("toy", "coco", "clean"), action="append")
    parser.add_argument("--toy-pairs", type=int, default=2000)
    parser.add_argument("--coco-limit", type=int, default=None, help="first N COCO images (default: all 5,000)")
    parser.add_argument("--clean-threshold", type=float, default=0.999,
                        help="image-side threshold of the keep comparison (the toy sweep's best F1 region)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dedup-quality-"))
    only = set(args.only or ("toy", "coco", "clean"))
    report: dict = {"default_threshold": DEFAULT_THRESHOLD}
    started = time.perf_counter()
    if only & {"toy", "clean"}:
        (work / "toy").mkdir(parents=True, exist_ok=True)
        report["toy"], duplicated, truth, estimator = toy(work / "toy", args.toy_pairs)
        for side in SIDES:
            print(f"\ntoy world, {side} side: recall per kind, precision and recall over all pairs\n"
                  + table(report["toy"], side))
        print("\ntoy world, image side, default threshold\n" + precision_table(report["toy"], "image", DEFAULT_THRESHOLD))
        if "clean" in only:
            (work / "clean").mkdir(exist_ok=True)
            report["clean"] = cleanest(work / "clean", duplicated, truth, estimator, args.clean_threshold)
    if "coco" in only:
        if not CAPTIONS.is_file():
            sys.exit(f"COCO captions not found at {CAPTIONS}")
        (work / "coco").mkdir(parents=True, exist_ok=True)
        report["coco"] = coco(work / "coco", args.coco_limit)
        for side in SIDES:
            print(f"\nCOCO text-text (MiniLM), {side} side\n" + table(report["coco"], side))
        print("\nCOCO, text side, default threshold\n" + precision_table(report["coco"], "text", DEFAULT_THRESHOLD))
    report["seconds"] = time.perf_counter() - started
    if args.json:
        write_json(args.json, report)
    print(f"\ndone in {report['seconds']:.0f} s; files under {work}")


if __name__ == "__main__":
    main()
