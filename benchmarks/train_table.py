"""Reproduce the training tables of docs/training.md.

    python benchmarks/train_table.py toy --out /tmp/pc-toy            # toy world, 0% / 50% shuffle noise
    python benchmarks/train_table.py coco-text --out /tmp/pc-coco     # MiniLM on COCO captions, 50% noise
    python benchmarks/train_table.py robust --out /tmp/pc-robust ...  # SPS / DiffNCL vs plain / OSA / oracle
    python benchmarks/train_table.py step-time --out /tmp/pc-step     # --weights vs plain step time
    python benchmarks/train_table.py step-time --out /tmp/pc-step-methods --methods sdd,gsc,gsc-2 --repeats 3
    python benchmarks/train_table.py methods --out /tmp/pc-methods --estimator /tmp/demo-estimator.pt
                                                                      # SDD, GSC vs plain / OSA / oracle, 3 seeds
    python benchmarks/train_table.py ablation --method gsc --out /tmp/pc-methods --estimator /tmp/demo-estimator.pt
                                                                      # each change of a method alone and together

Each subcommand builds its data, runs `pairclean.training.train` for every row of its table,
prints the table and writes it (JSON + Markdown) into --out. Finished runs are picked up
again (resume), so a killed table continues where it stopped. The runs use one intra-op thread
(`--threads`): on a shared 2-core machine, OpenMP's spinning threads made steps 10x slower.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import duckdb
import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from sklearn.metrics import roc_auc_score

from pairclean.errors import UserError
from pairclean.ops.atomic import atomic_path, write_json
from pairclean.calibrate.corrupt import corrupt
from pairclean.data.manifest import write_manifest
from pairclean.data.spec import DatasetSpec
from pairclean.scorefile.evaluation import evaluate_detection
from pairclean.data.writer import write_shards
from pairclean.scoring.model import ScoreConfig, score
from pairclean.scorefile.sql import sql_string
from pairclean.training.retrieval import evaluate_retrieval
from pairclean.lab.synth.estimator import TOY_MODEL, EstimatorRecipe
from pairclean.lab.synth.world import build_world
from pairclean.training import TrainConfig, train
from pairclean.training.checkpoint import BEST, STATE_FILE, epoch_model_name

console = Console(width=150)


def show(title: str, columns: list[str], rows: list[list], out: Path, name: str, extra: dict) -> None:
    """Print the table and write it as JSON and Markdown beside the runs."""
    table = Table(title=title)
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in rows:
        table.add_row(*(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row))
    console.print(table)
    md = [f"| {' | '.join(columns)} |", "|" + "---|" * len(columns)]
    md += ["| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row) + " |" for row in rows]
    with atomic_path(out / f"{name}.md") as tmp:
        tmp.write_text(f"{title}\n\n" + "\n".join(md) + "\n")
    write_json(out / f"{name}.json", {"title": title, "columns": columns, "rows": rows, **extra})


ROW_FILE = "row.json"  # a finished row's record, written beside the run once its checkpoints are pruned
VALIDATE = ("epochs", "last")


def prune_checkpoints(run_dir: Path, epochs: int) -> None:
    """Keep only the last epoch's model(s) of a finished run: state.pt (the model, its optimiser and a peer's:
    ~0.3-1 GB for MiniLM), model-best and the earlier epochs' exports go (a table of 50 runs filled the disk)."""
    last = epoch_model_name(epochs)
    for path in run_dir.iterdir():
        stale = path.name == STATE_FILE or path.name.startswith(BEST) or (
            path.name.startswith("model-epoch-") and not path.name.startswith(last))
        if stale:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def run_row(name: str, data: Path, out: Path, cfg: TrainConfig, val: Path, validate: str = "epochs") -> dict:
    """One table row: train, evaluate, record (OUT/row.json), keep only the last checkpoint; a row already
    recorded is read back, a run killed before its end resumes. `validate`: after every epoch (the trainer's
    validation; per-epoch rSum, best epoch) or once on the last model (saves an evaluation per epoch; the
    trainer's DataLoaders then draw the global RNG in another order, so a run is not bit-identical to the
    same run validated every epoch)."""
    record = out / ROW_FILE
    if record.is_file():
        row = json.loads(record.read_text())
    else:
        result = train(str(data), out, cfg, val=str(val) if validate == "epochs" else None)
        last = dict(result.epochs[-1])
        if validate == "last":
            measured = evaluate_retrieval(out, str(val), batch_size=cfg.val_batch_size, workers=cfg.workers)
            last.update({f"val_{k}": v for k, v in measured.to_json().items()})
        row = {"run": name, "rsum": last["val_rsum"], "best_rsum": result.best_rsum or last["val_rsum"],
               "i2t_r1": last["val_i2t_r1"], "t2i_r1": last["val_t2i_r1"], "epochs": len(result.epochs),
               "minutes": sum(r["seconds"] for r in result.epochs) / 60, "validate": validate,
               "train_loss": [r["train_loss"] for r in result.epochs], "steps": [r["steps"] for r in result.epochs],
               "val_rsum_per_epoch": [r.get("val_rsum") for r in result.epochs]}
        write_json(record, row)
        prune_checkpoints(out, cfg.epochs)
    row["run"] = name
    console.print(f"{name}: rSum {row['rsum']:.1f} (best {row['best_rsum']:.1f}), {row['minutes']:.1f} min")
    return row


def table_row(name: str, data: Path, out: Path, cfg: TrainConfig, val: Path) -> dict:
    """`run_row`, or - where the run is refused before its first step (a filter that keeps no pair,
    its rule abstaining on a small world) - a row that says why, so one such row does not cost the table."""
    try:
        return run_row(name, data, out, cfg, val)
    except UserError as exc:
        console.print(f"{name}: not run: {exc}")
        return {"run": name, "not_run": str(exc)}


def rows_with_share(rows: list[dict], clean: float) -> list[list]:
    """The table's rows; a row that could not run says why, its figures "-"."""
    return [[f"{r['run']} (not run: {r['not_run']})", "-", "-", "-", "-", "-", 0, 0.0] if r.get("not_run") else
            [r["run"], r["rsum"], 100.0 * r["rsum"] / clean, r["best_rsum"], r["i2t_r1"], r["t2i_r1"], r["epochs"],
             r["minutes"]] for r in rows]


ROW_COLUMNS = ["run", "rSum (last)", "% of clean", "rSum (best)", "i2t R@1", "t2i R@1", "epochs", "train min"]


def detection_summary(scores: Path, truth: Path) -> dict:
    d = evaluate_detection(scores, truth)
    return {"roc_auc": d.roc_auc, "beta_clean_kept": d.rules["beta"].clean_kept,
            "beta_noise_caught": d.rules["beta"].noise_caught, "gmm_clean_kept": d.rules["gmm"].clean_kept,
            "gmm_noise_caught": d.rules["gmm"].noise_caught, "noisy": d.noisy, "pairs": d.pairs}


class ToyData(NamedTuple):
    clean: Path  # manifests
    val: Path
    noisy: Path
    scores: Path
    truth: Path
    oracle: Path  # the scores plus the truth column, for the oracle filter row
    estimator: Path
    detection: dict


def toy_cfg(args, pretrained: str = "none", **kw) -> TrainConfig:
    settings = {"model": args.model, "epochs": args.epochs, "lr": args.lr, "warmup_steps": args.warmup_steps,
                "batch_size": args.batch_size, "temperature": args.temperature, **kw}
    return TrainConfig(pretrained=pretrained, weight_decay=0.1, workers=args.workers, seed=args.seed, resume=True,
                       **settings)


def toy_data(args, out: Path, noisy_name: str | None = None, make_noise=None) -> ToyData:
    """The toy worlds, the noisy copy (default: `--noise` shuffle noise; else `make_noise(clean_manifest,
    directory)` into `noisy_name`), the estimator's scores of it and the oracle's scores (built once)."""
    out.mkdir(parents=True, exist_ok=True)
    if args.init == "estimator":  # fine-tuning the estimator: every row trains its architecture
        args.model = args.estimator_model
    captions = args.captions_per_scene
    worlds = {"train": (0, args.pairs, captions), "val": (args.val_seed, args.val_pairs, captions)}
    if not args.estimator:
        worlds["estimator"] = (2, args.pairs, 1)
    for name, (seed, n, k) in worlds.items():
        if not (out / f"world-{name}").exists():
            build_world(out / f"world-{name}", n, seed=seed, shard_size=args.shard_size, captions_per_scene=k)
    clean, val = out / "world-train" / "manifest.yaml", out / "world-val" / "manifest.yaml"
    noisy = out / (noisy_name or f"noisy-{args.noise:g}")
    if not noisy.exists():
        (make_noise or (lambda source, target: corrupt(source, target, args.noise, seed=0)))(str(clean), noisy)
    noisy_manifest = noisy / "manifest.yaml"
    estimator = Path(args.estimator) if args.estimator else None
    if estimator is None:  # the toy estimator: trained from scratch on a disjoint clean world (seed 2)
        est = train(str(out / "world-estimator" / "manifest.yaml"), out / "estimator",
                    toy_cfg(args, model=args.estimator_model, epochs=args.estimator_epochs, lr=args.estimator_lr,
                            batch_size=args.estimator_batch_size, warmup_steps=args.estimator_warmup_steps,
                            temperature=args.estimator_temperature), val=str(val))
        estimator = est.best_model
    scores = out / "scores.parquet"
    if not scores.exists():
        score(str(noisy_manifest), scores, ScoreConfig(model=args.estimator_model, pretrained=str(estimator), batch_size=256,
                                                       workers=args.workers, seed=0))
    truth = noisy / "truth" / "truth.parquet"
    detection = detection_summary(scores, truth)
    console.print(f"estimator on the noisy set: {detection}")
    oracle = oracle_scores(scores, truth, out / "scores-with-truth.parquet")
    return ToyData(clean, val, noisy_manifest, scores, truth, oracle, estimator, detection)


def toy(args) -> None:
    """Tiny CLIP from scratch on the toy world: clean vs 50% shuffle noise, plain / OSA / filter / online."""
    out = Path(args.out)
    world = toy_data(args, out)
    clean, val, noisy_manifest, scores, oracle, estimator = (world.clean, world.val, world.noisy, world.scores,
                                                             world.oracle, world.estimator)
    detection, captions = world.detection, args.captions_per_scene

    def cfg(pretrained: str = "none", **kw) -> TrainConfig:
        return toy_cfg(args, pretrained, **kw)

    init = "none" if args.init == "scratch" else str(estimator)
    # Fine-tuning the estimator itself is the official OSA setting: its online estimator is then a
    # frozen copy of the initial model; from scratch the online estimator is the toy estimator.
    online = {} if args.init == "estimator" else {"estimator_model": args.estimator_model,
                                                  "estimator_pretrained": str(estimator)}
    noise = f"{args.noise:.0%} noise"
    runs = [("0% noise, plain", clean, cfg(init)),
            (f"{noise}, plain", noisy_manifest, cfg(init)),
            (f"{noise}, OSA weights", noisy_manifest, cfg(init, method="osa-weights",
                                                          method_options={"scores": str(scores)})),
            (f"{noise}, filter weight > 0", noisy_manifest, cfg(init, method="filter",
                                                                 method_options={"scores": str(scores),
                                                                                 "filter": "weight > 0"})),
            (f"{noise}, filter p_clean >= 0.5", noisy_manifest, cfg(init, method="filter",
                                                                     method_options={"scores": str(scores),
                                                                                     "filter": "p_clean >= 0.5"})),
            (f"{noise}, online OSA", noisy_manifest, cfg(init, method="osa-online", method_options=online)),
            (f"{noise}, oracle filter (truth)", noisy_manifest, cfg(init, method="filter",
                                                                    method_options={"scores": str(oracle),
                                                                                    "filter": "NOT noisy"}))]
    chosen = range(len(runs)) if args.rows is None else [int(r) for r in args.rows.split(",") if r]
    rows = [table_row(name, data, out / f"run-{args.init}-{i}", c, val) for i, (name, data, c) in enumerate(runs)
            if i in chosen]
    if len(rows) < len(runs):  # a partial table (--rows): the rows are printed, no table is written
        return
    start = "from scratch" if args.init == "scratch" else "fine-tuned from the toy estimator"
    scenes = f" ({args.pairs // captions} scenes x {captions} captions)" if captions > 1 else ""
    show(f"toy world: {args.model} {start}, {args.pairs} pairs{scenes}, {args.epochs} epochs, val {args.val_pairs} pairs",
         ROW_COLUMNS, rows_with_share(rows, rows[0]["rsum"]), out, f"table-{args.init}",
         {"detection": detection, "estimator": str(estimator), "args": vars(args)})


class MethodRow(NamedTuple):
    """One row of the methods tables: what it trains on and how, and how its pair table reads against the truth."""
    key: str
    label: str
    on_clean: bool  # trains on the clean data (the reference row), else on the noisy copy
    settings: dict  # TrainConfig fields
    partition: str | None = None  # a key of partition_summary's readings, for the methods that log a partition


def method_rows(scores: Path, oracle: Path, sdd: dict, sps: dict, diffncl: dict) -> list[MethodRow]:
    """Every row of the toy and COCO methods tables, in table order (index = the run directory's number)."""
    return [MethodRow("clean", "clean data, plain", True, {}),
            MethodRow("plain", "plain", False, {}),
            MethodRow("osa-weights", "OSA weights", False,
                      {"method": "osa-weights", "method_options": {"scores": str(scores)}}),
            MethodRow("oracle", "oracle filter", False,
                      {"method": "filter", "method_options": {"scores": str(oracle), "filter": "NOT noisy"}}),
            MethodRow("sdd", "SDD", False, {"method": "sdd", "method_options": sdd}, "sdd"),
            MethodRow("gsc", "GSC, one network", False, {"method": "gsc"}, "gsc"),
            MethodRow("gsc-2", "GSC, two networks", False, {"method": "gsc", "method_options": {"networks": "2"}},
                      "gsc"),
            MethodRow("sps", "SPS", False, {"method": "sps", "method_options": sps}, "sps"),
            MethodRow("diffncl", "DiffNCL", False, {"method": "diffncl", "method_options": diffncl}, "diffncl")]


def chosen_rows(spec: str | None, rows: list[MethodRow]) -> list[int]:
    """--rows: indices or keys, comma-separated (None: every row)."""
    if spec is None:
        return list(range(len(rows)))
    keys = [r.key for r in rows]
    picked = []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        if item.isdigit() and int(item) < len(rows):
            picked.append(int(item))
        elif item in keys:
            picked.append(keys.index(item))
        else:
            raise SystemExit(f"unknown row {item!r}; rows are 0-{len(rows) - 1} or {', '.join(keys)}")
    return sorted(set(picked))


def oracle_scores(scores: Path, truth: Path, out: Path) -> Path:
    """The estimator's scores plus the truth's `noisy` column, for the oracle filter row; refuses a truth that
    does not cover every scored pair (a join on moved shards would silently leave the oracle nothing to keep)."""
    if not out.exists():
        duckdb.execute(f"COPY (SELECT s.*, t.noisy FROM read_parquet({sql_string(scores)}) s JOIN "
                       f"read_parquet({sql_string(truth)}) t USING (shard, \"index\")) TO {sql_string(out)} "
                       "(FORMAT parquet)")
    joined = duckdb.execute(f"SELECT count(*) FROM read_parquet({sql_string(out)})").fetchone()[0]
    scored = duckdb.execute(f"SELECT count(*) FROM read_parquet({sql_string(scores)})").fetchone()[0]
    if joined != scored:
        raise SystemExit(f"{out}: the truth matches {joined} of {scored} scored pairs (moved shards?); delete it and "
                         "rebuild the noisy copy")
    return out


# What each method's last pair table (RUN_DIR/diagnostics/pairs-epoch-NNN.parquet) calls noisy. SDD: the
# self-dropped pairs (its second reading: also the vague ones, w_con < 0.5); GSC: label y < 0.5; SPS: its noisy
# set (reliable and quasi-clean pairs train); DiffNCL: not clean (its weak and noisy sets), and its three-way
# partition against the three-way truth (clean / weak / shuffle = noisy).
FLAGGED = {"sdd": "d.partition = 'noisy'", "gsc": "d.partition = 'noisy'", "sps": "d.partition = 'noisy'",
           "diffncl": "d.partition <> 'clean'"}
TRUTH_KIND = "CASE WHEN NOT t.noisy THEN 'clean' ELSE coalesce(t.noise, 'shuffle') END"  # clean / weak / shuffle
SECOND_READING = {"sdd": ("with vague", "CAST(d.partition IN ('noisy', 'vague') = t.noisy AS DOUBLE)"),
                  "diffncl": ("3-way", ("CAST(d.partition = CASE WHEN NOT t.noisy THEN 'clean' WHEN t.noise = 'weak' "
                                        "THEN 'weak' ELSE 'noisy' END AS DOUBLE)"))}
# Each method's per-pair soft reading of cleanliness (higher = cleaner): its ranking, whatever its cut.
CLEAN_SCORE = {"sdd": "sim", "gsc": "y", "sps": "p", "diffncl": "p_clean"}


def partition_summary(run: Path, truth: Path, kind: str) -> dict:
    """The last epoch's partition against the truth, one DuckDB join on (shard, index): accuracy, noise caught
    and clean kept (%) of FLAGGED[kind], the second reading where there is one, the counts per (partition,
    truth kind), and for DiffNCL Psi's and the loss's mean per truth kind. Refuses a table the truth does not
    cover (a join on moved shards would read as a partition of nothing)."""
    tables = sorted((run / "diagnostics").glob("pairs-epoch-*.parquet"))
    if not tables:
        return {}
    table, truth_file = sql_string(tables[-1]), sql_string(truth)
    join = f"FROM read_parquet({table}) d JOIN read_parquet({truth_file}) t USING (shard, \"index\")"
    pairs, joined = duckdb.execute(f"SELECT count(*), count(t.noisy) FROM read_parquet({table}) d LEFT JOIN "
                                   f"read_parquet({truth_file}) t USING (shard, \"index\")").fetchone()
    if joined != pairs:
        raise SystemExit(f"{tables[-1]}: the truth matches {joined} of its {pairs} pairs")
    flagged = FLAGGED[kind]
    second = SECOND_READING.get(kind, ("", "NULL"))
    accuracy, caught, kept, other = duckdb.execute(
        f"""SELECT 100 * avg(CAST(({flagged}) = t.noisy AS DOUBLE)),
                   100 * avg(CAST({flagged} AS DOUBLE)) FILTER (WHERE t.noisy),
                   100 * avg(CAST(NOT ({flagged}) AS DOUBLE)) FILTER (WHERE NOT t.noisy),
                   100 * avg({second[1]}) {join}""").fetchone()
    summary = {"epoch": tables[-1].name, "accuracy": accuracy, "noise_caught": caught, "clean_kept": kept}
    soft, noisy = zip(*duckdb.execute(f"SELECT d.{CLEAN_SCORE[kind]}, t.noisy {join}").fetchall())
    summary["soft_auc"] = 100.0 * roc_auc_score(np.logical_not(noisy), soft) if 0 < sum(noisy) < len(noisy) else None
    if second[0]:
        summary["second_reading"] = {"name": second[0], "accuracy": other}
    summary["counts"] = dict(duckdb.execute(f"SELECT d.partition || ' / ' || {TRUTH_KIND}, count(*) {join} "
                                            "GROUP BY 1 ORDER BY 1").fetchall())
    if kind == "gsc":  # the labels of every epoch by truth kind (the per-epoch tables, one query)
        every = sql_string(str(run / "diagnostics" / "pairs-epoch-*.parquet"))
        summary["y_by_epoch"] = [
            {"epoch": e, "kind": k, "y": y, "y_cm": cm, "y_im": im} for e, k, y, cm, im in duckdb.execute(
                f"SELECT d.epoch, {TRUTH_KIND}, avg(d.y), avg(d.y_cm), avg(d.y_im) FROM read_parquet({every}) d "
                f"JOIN read_parquet({truth_file}) t USING (shard, \"index\") GROUP BY ALL ORDER BY ALL").fetchall()]
    if kind == "diffncl":
        summary["psi_by_truth"] = {k: {"psi": m, "psi_peer": mp, "loss": ml, "pairs": n} for k, m, mp, ml, n in
                                   duckdb.execute(f"SELECT {TRUTH_KIND}, avg(d.psi), avg(d.psi_peer), avg(d.loss), "
                                                  f"count(*) {join} GROUP BY 1 ORDER BY 1").fetchall()}
    return summary


def run_methods(out: Path, rows: list[MethodRow], chosen: list[int], seeds: list[int], make_cfg, clean: Path,
                noisy: Path, val: Path, truth: Path, validate: str = "epochs", place=None) -> dict[str, list[dict]]:
    """Train (or pick up) every chosen row at every seed into out/seed-S/run-I, or where `place(i, row, seed)`
    puts it (a run another table shares: the clean-data row of every noise kind, an ablation's defaults row);
    the partition summaries."""
    results: dict[str, list[dict]] = {}
    for seed in seeds:
        for i in chosen:
            row = rows[i]
            run_dir = (place and place(i, row, seed)) or out / f"seed-{seed}" / f"run-{i}"
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            record = run_row(f"{row.label} (seed {seed})", clean if row.on_clean else noisy, run_dir,
                             make_cfg(seed, row.settings), val, validate)
            if row.partition:
                record["partition"] = partition_summary(run_dir, truth, row.partition)
                shown = {k: v for k, v in record["partition"].items() if k != "counts"}
                console.print(f"{row.label} (seed {seed}) partition: {shown}")
            record["seed"] = seed
            results.setdefault(row.key, []).append(record)
    return results


def spread(values: list[float]) -> str:
    """mean ± half-range (one value: the value)."""
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.mean(values):.1f} ± {(max(values) - min(values)) / 2:.1f}"


METHOD_COLUMNS = ["run", "rSum", "% of oracle filter", "rSum per seed", "partition accuracy % (last epoch)",
                  "noise caught / clean kept %", "soft-label ROC-AUC %", "train min"]


def methods_rows(rows: list[MethodRow], chosen: list[int], results: dict[str, list[dict]]) -> list[list]:
    """The table: rSum and % of the oracle filter (each seed against its own oracle run) as mean ± half-range."""
    oracle = {r["seed"]: r["rsum"] for r in results.get("oracle", [])}
    table = []
    for i in chosen:
        row, runs = rows[i], results[rows[i].key]
        share = spread([100.0 * r["rsum"] / oracle[r["seed"]] for r in runs]) if oracle else "-"
        accuracy = caught = auc = "-"
        if row.partition:
            parts = [r["partition"] for r in runs]
            accuracy = spread([p["accuracy"] for p in parts])
            if "second_reading" in parts[0]:
                accuracy += f" ({parts[0]['second_reading']['name']}: " \
                            f"{spread([p['second_reading']['accuracy'] for p in parts])})"
            caught = f"{spread([p['noise_caught'] for p in parts])} / {spread([p['clean_kept'] for p in parts])}"
            if all(p["soft_auc"] is not None for p in parts):
                auc = spread([p["soft_auc"] for p in parts])
        table.append([row.label, spread([r["rsum"] for r in runs]), share, " / ".join(f"{r['rsum']:.1f}" for r in runs),
                      accuracy, caught, auc, f"{statistics.mean(r['minutes'] for r in runs):.1f}"])
    return table


def detection_reference(det: dict) -> list:
    """OSA's own scores of the noisy set read as a partition (beta rule / GMM rule), the reference to beat."""
    def accuracy(rule: str) -> float:
        return 100.0 * (det["noisy"] * det[f"{rule}_noise_caught"] / 100 + (det["pairs"] - det["noisy"])
                        * det[f"{rule}_clean_kept"] / 100) / det["pairs"]
    return ["(reference) OSA scores: beta rule / GMM", "-", "-", "-", f"{accuracy('beta'):.1f} / {accuracy('gmm'):.1f}",
            (f"beta {det['beta_noise_caught']:.1f} / {det['beta_clean_kept']:.1f}; GMM {det['gmm_noise_caught']:.1f} / "
             f"{det['gmm_clean_kept']:.1f}"), f"{100 * det['roc_auc']:.1f}", "-"]


def noise_copy(args) -> tuple[str, str, object]:
    """The noisy copy's directory name, its label and the function that writes it: shuffle (--noise), weak
    (--weak-noise with --noise 0: `pairclean corrupt --mode weak`, about 30% of a caption's words replaced by
    random words of the captions' vocabulary), or mixed (both)."""
    if args.weak_noise and not args.noise:
        return (f"noisy-weak-{args.weak_noise:g}", f"{args.weak_noise:.0%} weak",
                lambda clean, noisy: corrupt(str(clean), noisy, args.weak_noise, seed=0, mode="weak"))
    if args.weak_noise:
        label = f"{args.weak_noise:.0%} weak + {args.noise:.0%} shuffle"
        return (f"noisy-{args.noise:g}-weak-{args.weak_noise:g}", label,
                lambda clean, noisy: corrupt(str(clean), noisy, args.noise, seed=0, mode="mixed",
                                             weak_ratio=args.weak_noise))
    return (f"noisy-{args.noise:g}", f"{args.noise:.0%} shuffle",
            lambda clean, noisy: corrupt(str(clean), noisy, args.noise, seed=0))


def method_options(args) -> tuple[dict, dict, dict]:
    """SDD's, SPS's and DiffNCL's options from the command line (strings, as `--method-option` passes them);
    a schedule option not given is left to the method (the paper's proportions of --epochs)."""
    def given(**values) -> dict:
        return {k: str(v) for k, v in values.items() if v is not None}
    sdd = {"alpha": str(args.sdd_alpha), "beta": str(args.sdd_beta)}
    sps = given(warmup_epochs=args.warmup_epochs, e_qc=args.e_qc, e_n=args.e_n, eps1=args.sps_eps1)
    return sdd, sps, given(warmup_epochs=args.warmup_epochs)


def methods_table(args) -> None:
    """The robust-training methods (SDD, GSC one / two networks, SPS, DiffNCL) against plain, OSA weights
    and the oracle filter, fine-tuning the toy estimator, over training seeds."""
    out = Path(args.out)
    name, noise, make = noise_copy(args)
    world = toy_data(args, out, name, make)
    init = str(world.estimator) if args.init == "estimator" else "none"
    rows = method_rows(world.scores, world.oracle, *method_options(args))
    chosen, seeds = chosen_rows(args.rows, rows), [int(x) for x in args.seeds.split(",")]

    def make_cfg(seed: int, settings: dict) -> TrainConfig:
        args.seed = seed
        return toy_cfg(args, init, **settings)

    results = run_methods(out, rows, chosen, seeds, make_cfg, world.clean, world.noisy, world.val, world.truth)
    table = methods_rows(rows, chosen, results) + [detection_reference(world.detection)]
    start = "fine-tuning the toy estimator" if args.init == "estimator" else "from scratch"
    show(f"robust-training methods, toy world {args.pairs} pairs ({args.pairs // args.captions_per_scene} scenes x "
         f"{args.captions_per_scene} captions), {noise} noise, {args.model} {start}, {args.epochs} epochs, lr "
         f"{args.lr:g}, batch {args.batch_size}; mean ± half-range over seeds {args.seeds}", METHOD_COLUMNS, table, out,
         f"table-methods-rows-{'-'.join(map(str, chosen))}" if args.rows else "table-methods",
         {"runs": results, "detection": world.detection, "args": vars(args)})


# Each changed method's variants: the state before issue 26 (as the tables measured it), the paper's letter
# where it differs, each change alone on top of it, all changes (the method's defaults), and all but one.
_GSC_LETTER = {"y_cm": "softmax", "structure": "paper", "init_labels": "ones"}
_DIFFNCL_BEFORE = {"cross": "as-written", "shared_noise": "true", "temperature": "none", "loops": "rows",
                   "order_by": "sum", "zeta_on": "raw", "warmup_epochs": "1"}
_DIFFNCL_CHANGES = {"cross": "L_cross per the prose", "shared_noise": "independent draws",
                    "temperature": "temperature 0.07", "loops": "clean / weak loops (Algorithm 1)",
                    "order_by": "components ordered by loss", "zeta_on": "zeta on the normalised loss",
                    "warmup_epochs": "warm-up scaled (0 of 4)"}
_SPS_BEFORE = {"gmm_max_iter": "100", "gmm_tol": "0.001", "batches": "rows", "warmup_epochs": "1", "e_qc": "2",
               "e_n": "3"}
_SPS_CHANGES = {"gmm_max_iter": "GMM as the code (10 iterations, tol 1e-2)", "batches": "full batches per kind",
                "warmup_epochs": "schedule scaled (0, 2, 3)"}
_SPS_TOGETHER = {"gmm_max_iter": ("gmm_tol",), "warmup_epochs": ("e_qc", "e_n")}  # options that change together


def _alone_and_without(before: dict, changes: dict, together: dict) -> list[tuple[str, dict]]:
    """before + each change alone, then the defaults (every change) and the defaults without each one."""
    def keys(key):
        return (key, *together.get(key, ()))
    rows = [("before issue 26", dict(before))]
    rows += [(f"before + {label}", {k: v for k, v in before.items() if k not in keys(key)})
             for key, label in changes.items()]
    rows.append(("every change (the defaults)", {}))
    rows += [(f"defaults without: {label}", {k: before[k] for k in keys(key)}) for key, label in changes.items()]
    return rows


ABLATIONS = {
    "gsc": [("before issue 26 (tau1 = the run's 0.02, the letter)", {"tau1": "none", **_GSC_LETTER}),
            ("the paper's letter (tau1 0.07)", dict(_GSC_LETTER)),
            ("letter + calibrated y_CM posterior", {"structure": "paper", "init_labels": "ones"}),
            ("letter + centred intra-modal rows", {"y_cm": "softmax", "init_labels": "ones"}),
            ("letter + labels from a pass", {"y_cm": "softmax", "structure": "paper"}),
            ("every change (the defaults)", {}),
            ("defaults without the posterior", {"y_cm": "softmax"}),
            ("defaults without centred rows", {"structure": "paper"}),
            ("defaults without the pass", {"init_labels": "ones"}),
            ("defaults, tau1 = the run's 0.02", {"tau1": "none"})],
    "diffncl": _alone_and_without(_DIFFNCL_BEFORE, _DIFFNCL_CHANGES, {}) + [
        ("defaults, denoising from step 3 of 4", {"denoise_from": "3"}),
        ("defaults, noisy pairs through the denoiser (Alg. 1: D_w and D_n)", {"noisy_as_weak": "true"})],
    # (eps1 = 0.99, the paper's text, is no variant: no pair is reliable and the run stops with that error)
    "sps": _alone_and_without(_SPS_BEFORE, _SPS_CHANGES, _SPS_TOGETHER),
}


# Issue 35 (COCO captions: a strong pre-trained encoder, a 2-epoch fine-tune): why a method gains little there, one
# change a row: the update count, the batch source, the partition's thresholds and what trains on each part, the
# temperature. `coco-text --ablation M` and `ablation --method M --variants one-change` (the toy world).
ONE_CHANGE = {
    "sps": [("defaults", {}),
            ("as many iterations as plain training (the reliable pairs re-read)", {"epoch": "all"}),
            ("the rows of one batch of every pair", {"batches": "rows"}),
            ("more reliable pairs: every p > 0.5 (eps1 = eps2)", {"eps1": "0.5"}),
            ("fewer reliable pairs: p > 0.9", {"eps1": "0.9"}),
            ("no stable-space constraints", {"lambda_cro": "0", "lambda_met": "0"}),
            ("reliable pairs only (no quasi-clean or proxy steps)", {"e_qc": "99", "e_n": "99"})],
    "diffncl": [("defaults", {}),
                ("as many steps as plain training (the clean pairs re-read)", {"epoch": "all"}),
                ("the rows of one batch of every pair", {"loops": "rows"}),
                ("one pass over the weak pairs per epoch (Algorithm 1)", {"weak_loop": "once"}),
                ("weak pairs not trained (the consensus's clean pairs only)", {"weak_loop": "none"}),
                ("temperature = the run's", {"temperature": "none"})],
}


def ablation_table(args) -> None:
    """One method's variants (ABLATIONS) on the methods table's toy world, over --seeds: what each change does
    alone and together. Runs live in OUT/ablation-METHOD; the data is the methods table's (same --out)."""
    out = Path(args.out)
    name, noise, make = noise_copy(args)
    world = toy_data(args, out, name, make)
    init = str(world.estimator) if args.init == "estimator" else "none"
    variants = (ABLATIONS if args.variants == "repairs" else ONE_CHANGE)[args.method]
    rows = ablation_rows(args.method, variants)
    chosen, seeds = chosen_rows(args.rows, rows), [int(x) for x in args.seeds.split(",")]

    def make_cfg(seed: int, settings: dict) -> TrainConfig:
        args.seed = seed
        return toy_cfg(args, init, **settings)

    where = out / (f"ablation-{args.method}" + ("" if args.variants == "repairs" else f"-{args.variants}"))
    results = run_methods(where, rows, chosen, seeds, make_cfg, world.clean, world.noisy, world.val, world.truth)
    show_ablation(f"{args.method} ablation ({args.variants}), toy world {args.pairs} pairs, {noise} noise, seeds "
                  f"{args.seeds}", args, variants, rows, chosen, results, where)


def ablation_rows(method: str, variants: list[tuple[str, dict]]) -> list[MethodRow]:
    """One row per variant: the method with the variant's options (strings, as --method-option passes them);
    a `method` key in the options names another method (a row of reference, e.g. the oracle filter)."""
    rows = []
    for i, (label, options) in enumerate(variants):
        options = dict(options)
        name = options.pop("method", method)
        rows.append(MethodRow(f"{method}-{i}", label, False, {"method": name, "method_options": options},
                              name if name in FLAGGED else None))
    return rows


def show_ablation(title: str, args, variants: list, rows: list[MethodRow], chosen: list[int], results: dict,
                  out: Path) -> None:
    """The ablation table: per variant its options, rSum (mean ± half-range and per seed), the partition's
    accuracy and what it trains on (the last epoch's steps)."""
    table = []
    for i in chosen:
        runs = results[rows[i].key]
        parts = [r.get("partition") or {} for r in runs]
        accuracy = "-"
        if all("accuracy" in p for p in parts):
            second = f" ({spread([p['second_reading']['accuracy'] for p in parts])})" if "second_reading" in parts[0] \
                else ""
            accuracy = spread([p["accuracy"] for p in parts]) + second
        steps = " / ".join(str(r["steps"][-1]) for r in runs) if all("steps" in r for r in runs) else "-"
        table.append([rows[i].label, " ".join(f"{k}={v}" for k, v in variants[i][1].items()) or "-",
                      spread([r["rsum"] for r in runs]), " / ".join(f"{r['rsum']:.1f}" for r in runs), accuracy, steps])
    method = rows[0].key.rsplit("-", 1)[0]
    show(title, ["variant", "options", "rSum", "rSum per seed", "partition accuracy %", "steps (last epoch)"], table,
         out, f"table-ablation-{method}" + (f"-rows-{'-'.join(map(str, chosen))}" if args.rows else ""),
         {"runs": results, "variants": variants, "args": vars(args)})


def _coco_val(captions_json: Path, skip: int, n: int, out: Path) -> Path:
    """Held-out images: (caption 0, caption j) for j = 1..4, so one query item has four right items."""
    data = json.loads(captions_json.read_text())
    by_image: dict[int, list[str]] = {}
    for ann in data["annotations"]:
        by_image.setdefault(int(ann["image_id"]), []).append(str(ann["caption"]).strip())
    images = [i for i, caps in sorted(by_image.items()) if len(caps) >= 2][skip:skip + n]
    out.mkdir(parents=True)
    write_shards(({"__key__": f"{i:012d}_{j}", "txt": by_image[i][0], "txt2": by_image[i][j]}
                  for i in images for j in range(1, min(len(by_image[i]), 5))), out, prefix="coco-val", maxcount=1000)
    spec = DatasetSpec(format="webdataset", shards=[str(p) for p in sorted(out.glob("coco-val-*.tar"))],
                       pair="text-text", name="coco-text-val")
    write_manifest(out / "manifest.yaml", spec)
    return out / "manifest.yaml"


def coco_text(args) -> None:
    """all-MiniLM-L6-v2 fine-tuned on COCO caption pairs. Zero-shot, clean, plain and OSA weights at --noise
    (docs/training.md); with --methods, every row of the methods table over --seeds (docs/methods.md)."""
    from pairclean.lab.coco_text import build_text_pairs

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    captions = Path(args.captions)
    if not (out / "train").exists():
        build_text_pairs(captions, out / "train", shard_size=args.shard_size, limit=args.pairs)
    clean, val = out / "train" / "manifest.yaml", out / "val" / "manifest.yaml"
    if not val.exists():
        _coco_val(captions, args.pairs, args.val_images, out / "val")
    name, noise, make = noise_copy(args)
    noisy = out / name
    if not noisy.exists():
        make(clean, noisy)
    truth = noisy / "truth" / "truth.parquet"
    scores = out / f"scores-{name}.parquet"
    if not scores.exists():
        score(str(noisy / "manifest.yaml"), scores, ScoreConfig(backend="sentence-transformers", model=args.model,
                                                                batch_size=128, workers=args.workers, seed=0))
    detection = detection_summary(scores, truth)
    console.print(f"estimator on the noisy set: {detection}")
    zero_shot_file = out / "zero-shot.json"  # the untrained model's retrieval, measured once per --out
    if not zero_shot_file.exists():
        write_json(zero_shot_file, evaluate_retrieval(args.model, str(val), workers=args.workers).to_json())
    zero_shot = json.loads(zero_shot_file.read_text())
    warmup = max(1, (args.pairs // args.batch_size) // 10)

    def make_cfg(seed: int, settings: dict) -> TrainConfig:
        return TrainConfig(model=args.model, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                           weight_decay=0.01, warmup_steps=warmup, workers=args.workers, seed=seed, resume=True,
                           **settings)

    title = (f"COCO captions text-text: {args.model}, {args.pairs} train pairs, {args.val_images} held-out images x 4 "
             f"captions, {noise} noise, {args.epochs} epoch(s)")
    seeds = [int(x) for x in args.seeds.split(",")]
    table_rows = method_rows(scores, oracle_scores(scores, truth, out / f"scores-with-truth-{name}.parquet"),
                             *method_options(args))
    if args.ablation:
        variants = ONE_CHANGE[args.ablation]
        rows = ablation_rows(args.ablation, variants)
        chosen = chosen_rows(args.rows, rows)
        in_table = [r.key for r in table_rows].index(args.ablation)

        def place(i: int, row: MethodRow, seed: int) -> Path | None:  # the defaults row is the methods table's run
            return out / name / f"seed-{seed}" / f"run-{in_table}" if not variants[i][1] else None

        results = run_methods(out / name / f"ablation-{args.ablation}", rows, chosen, seeds, make_cfg, clean,
                              noisy / "manifest.yaml", val, truth, args.validate, place)
        show_ablation(f"{args.ablation} ablation, {title}, seeds {args.seeds}", args, variants, rows, chosen, results,
                      out / name / f"ablation-{args.ablation}")
        return
    if args.methods:
        rows, chosen = table_rows, chosen_rows(args.rows, table_rows)
        results = run_methods(out / name, rows, chosen, seeds, make_cfg, clean, noisy / "manifest.yaml", val, truth,
                              args.validate, lambda i, row, seed: out / "clean" / f"seed-{seed}" / f"run-{i}"
                              if row.on_clean else None)
        table = [["zero-shot (no training)", f"{zero_shot['rsum']:.1f}", "-", "-", "-", "-", "-", "0"]]
        table += methods_rows(rows, chosen, results) + [detection_reference(detection)]
        show(f"{title}; mean ± half-range over seeds {args.seeds}", METHOD_COLUMNS, table, out / name,
             f"table-methods-rows-{'-'.join(map(str, chosen))}" if args.rows else "table-methods",
             {"runs": results, "detection": detection, "zero_shot": zero_shot, "args": vars(args)})
        return
    runs = [("0% noise, plain", clean, make_cfg(0, {})),
            (f"{noise}, plain", noisy / "manifest.yaml", make_cfg(0, {})),
            (f"{noise}, OSA weights", noisy / "manifest.yaml",
             make_cfg(0, {"method": "osa-weights", "method_options": {"scores": str(scores)}}))]
    rows = [run_row(label, data, out / f"run-{i}", c, val) for i, (label, data, c) in enumerate(runs)]
    table = [["zero-shot (no training)", zero_shot["rsum"], 100.0 * zero_shot["rsum"] / rows[0]["rsum"], "-",
              zero_shot["i2t_r1"], zero_shot["t2i_r1"], 0, 0.0]] + rows_with_share(rows, rows[0]["rsum"])
    show(title, ROW_COLUMNS, table, out, "table", {"detection": detection, "zero_shot": zero_shot, "args": vars(args)})


# Step-time rows: method and options. From a random init no pair clears SDD's alpha = 20 (cos 0.2),
# so SDD keeps every pair and banks every pair here: its whole machinery runs on every step.
# SPS and DiffNCL skip the warm-up, so the one timed epoch runs their partition, and SPS takes its three steps.
STEP_METHODS = {"osa-weights": ("osa-weights", "scores"), "sdd": ("sdd", {"alpha": "-100", "beta": "-100"}),
                "gsc": ("gsc", {}), "gsc-2": ("gsc", {"networks": "2"}),
                "sps": ("sps", {"warmup_epochs": "0", "e_qc": "1", "e_n": "1", "eps1": "0.6"}),
                "diffncl": ("diffncl", {"warmup_epochs": "0"})}


def step_time(args) -> None:
    """Per-step wall time of each method vs plain on the same shards: a discarded warm-up run, then
    interleaved repeats in rotating order, medians."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    world = out / "world"
    if not world.exists():
        build_world(world, args.pairs, seed=0, shard_size=args.shard_size)
    scores = out / "scores.parquet"
    if not scores.exists():
        score(str(world / "manifest.yaml"), scores, ScoreConfig(model=args.model, pretrained="none", beta_k=256,
                                                                 batch_size=256, workers=args.workers, seed=0))
    names = ["plain"] + [m for m in args.methods.split(",") if m]
    unknown = [m for m in names[1:] if m not in STEP_METHODS]
    if unknown:
        raise SystemExit(f"unknown --methods {unknown}; choose from {', '.join(STEP_METHODS)}")
    per_step: dict[str, list[float]] = {m: [] for m in names}
    compute: dict[str, list[float]] = {m: [] for m in names}
    setup: dict[str, list[float]] = {m: [] for m in names}

    def run(name: str, run_name: str):
        method, options = STEP_METHODS.get(name, ("plain", {}))
        options = {"scores": str(scores)} if options == "scores" else options
        cfg = TrainConfig(model=args.model, pretrained="none", epochs=1, batch_size=args.batch_size, lr=1e-3,
                          warmup_steps=10, workers=args.workers, method=method, method_options=options,
                          overwrite=True, seed=0)
        return train(str(world / "manifest.yaml"), out / run_name, cfg)

    run("plain", "run-warmup")  # first-run costs (allocator, kernels, page cache) land in no measurement
    for repeat in range(args.repeats):
        shift = repeat % len(names)  # no method always goes first
        for name in names[shift:] + names[:shift]:
            called = time.perf_counter()
            result = run(name, f"run-{name}-{repeat}")
            rec = result.epochs[0]
            per_step[name].append(rec["seconds"] / rec["steps"])
            compute[name].append(rec["compute_seconds_per_step"])
            setup[name].append(time.perf_counter() - called - result.seconds)
            console.print(f"repeat {repeat} {name}: {per_step[name][-1]:.4f} s/step "
                          f"(compute {compute[name][-1]:.4f}), setup {setup[name][-1]:.2f} s")
    med = {m: statistics.median(v) for m, v in per_step.items()}
    med_compute = {m: statistics.median(v) for m, v in compute.items()}
    med_setup = {m: statistics.median(v) for m, v in setup.items()}
    rows = [[m, med[m], med_compute[m], med_setup[m]] for m in names]
    for m in names[1:]:
        label = "weights" if m == "osa-weights" else m
        rows.append([f"ratio {label}/plain", med[m] / med["plain"], med_compute[m] / med_compute["plain"],
                     med_setup[m] / med_setup["plain"]])
    show(f"step time, {args.pairs} toy pairs, batch {args.batch_size}, {args.model}, median of {args.repeats}",
         ["run", "s/step (wall)", "s/step (compute)", "setup s"], rows, out, "table",
         {"per_step": per_step, "compute": compute, "setup": setup, "threads": torch.get_num_threads()})
    for m in names[1:]:
        target = " (target <= 1.03)" if m == "osa-weights" else ""
        console.print(f"step-time ratio {m} / plain: {med[m] / med['plain']:.3f}{target}")


def toy_arguments(parser, **defaults) -> None:
    """The toy world's options (the `toy` and `methods` tables); `defaults` replaces some defaults."""
    parser.add_argument("--out", required=True)
    parser.add_argument("--pairs", type=int, default=8000)
    parser.add_argument("--val-pairs", type=int, default=1000)
    parser.add_argument("--val-seed", type=int, default=1, help="world seed of the validation set (3 when --estimator is "
                                                                "the demo's, whose training world is seed 1)")
    parser.add_argument("--captions-per-scene", type=int, default=1,
                        help="COCO-style worlds: each scene under this many captions, in training and validation "
                             "(retrieval then uses the multi-caption protocol)")
    parser.add_argument("--noise", type=float, default=0.5)
    parser.add_argument("--shard-size", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--temperature", type=float, default=0.0, help="fixed InfoNCE temperature (0: learned)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--model", default="pairclean-tiny", help="the model every row trains")
    parser.add_argument("--estimator", help="estimator checkpoint (default: trained here on a disjoint clean world)")
    # The estimator trained here follows the toy estimator's recipe (the demo's) unless told otherwise.
    recipe = EstimatorRecipe()
    parser.add_argument("--estimator-model", default=TOY_MODEL)
    parser.add_argument("--estimator-epochs", type=int, default=recipe.epochs, help="epochs of the estimator trained here")
    parser.add_argument("--estimator-lr", type=float, default=recipe.lr, help="learning rate of the estimator trained here")
    parser.add_argument("--estimator-batch-size", type=int, default=recipe.batch_size)
    parser.add_argument("--estimator-warmup-steps", type=int, default=recipe.warmup_steps)
    parser.add_argument("--estimator-temperature", type=float, default=recipe.temperature or 0.0, help="0: learned")
    parser.add_argument("--seed", type=int, default=0, help="training seed of every row (initialisation, data order); "
                                                            "the data, noise and scores keep theirs")
    parser.add_argument("--rows", help="run only these rows (comma-separated indices, 0 = the clean run; '' builds the "
                                       "data only); the table itself needs every row")
    parser.add_argument("--init", choices=("scratch", "estimator"), default="scratch",
                        help="train every row from scratch, or fine-tune the estimator (the paper's setting)")
    parser.set_defaults(**defaults)


def method_arguments(parser, warmup_epochs: int | None = None, e_qc: int | None = None, e_n: int | None = None,
                     seeds: str = "0,1,2") -> None:
    """The methods tables' options: seeds, the noise mix, the methods' settings (papers' values where they fit;
    the schedules, unless given, each method's own: the paper's proportions of --epochs)."""
    parser.add_argument("--seeds", default=seeds, help="training seeds (comma-separated)")
    parser.add_argument("--weak-noise", type=float, default=0.0, help="share of the pairs weakened beside the --noise "
                                                                       "shuffled (pairclean corrupt --mode mixed)")
    parser.add_argument("--sdd-alpha", type=float, default=20.0, help="SDD's self-drop threshold (100 cos; the paper's)")
    parser.add_argument("--sdd-beta", type=float, default=30.0, help="SDD's memory-bank threshold (100 cos; the paper's)")
    parser.add_argument("--warmup-epochs", type=int, default=warmup_epochs, help="SPS and DiffNCL warm-up epochs "
                                                                                 "(default: the methods', 5 of 45 scaled)")
    parser.add_argument("--e-qc", type=int, default=e_qc, help="SPS: quasi-clean pairs from this epoch (default: "
                                                                 "the method's, 16 of 45 scaled)")
    parser.add_argument("--e-n", type=int, default=e_n, help="SPS: noisy pairs with proxies from this epoch (default: "
                                                               "the method's, 21 of 45 scaled)")
    parser.add_argument("--sps-eps1", type=float, default=None,
                        help="SPS reliable bound (default: the method's, the authors' code's 0.6; the paper's text says "
                             "0.99, which leaves no reliable pair when the loss GMM's clean posterior tops out below it)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    sub = parser.add_subparsers(dest="table", required=True)
    st = sub.add_parser("step-time", help="training step time of methods (default --weights) vs plain")
    st.add_argument("--out", required=True)
    st.add_argument("--pairs", type=int, default=2048)
    st.add_argument("--shard-size", type=int, default=512)
    st.add_argument("--batch-size", type=int, default=64)
    st.add_argument("--repeats", type=int, default=5)
    st.add_argument("--workers", type=int, default=1)
    st.add_argument("--model", default="pairclean-tiny")
    st.add_argument("--methods", default="osa-weights",
                    help=f"methods timed against plain, comma-separated, from: {', '.join(STEP_METHODS)}")
    ty = sub.add_parser("toy", help="toy world table (tiny CLIP from scratch)")
    toy_arguments(ty)
    mt = sub.add_parser("methods", help="robust-training methods (SDD, GSC, SPS, DiffNCL) against plain, OSA weights "
                                        "and the oracle filter, fine-tuning the toy estimator on five captions per scene")
    toy_arguments(mt, noise=0.4, pairs=8000, val_pairs=5000, val_seed=3, captions_per_scene=5, epochs=4, lr=3e-4,
                  warmup_steps=20, temperature=0.02, init="estimator")
    method_arguments(mt)
    ab = sub.add_parser("ablation", help="one method's variants: each change alone and together (same world and "
                                         "options as `methods`)")
    toy_arguments(ab, noise=0.4, pairs=8000, val_pairs=5000, val_seed=3, captions_per_scene=5, epochs=4, lr=3e-4,
                  warmup_steps=20, temperature=0.02, init="estimator")
    method_arguments(ab, seeds="0")
    ab.add_argument("--method", required=True, choices=sorted(ABLATIONS))
    ab.add_argument("--variants", choices=("repairs", "one-change"), default="repairs",
                    help="repairs: issue 26's changes, each alone and each left out; one-change: issue 35's rows "
                         "(update count, batch source, partition thresholds, weak loop, temperature; sps, diffncl)")
    ct = sub.add_parser("coco-text", help="COCO captions text-text table (all-MiniLM-L6-v2)")
    ct.add_argument("--out", required=True)
    ct.add_argument("--captions", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "coco-captions"
                                              / "captions_val2017.json"))
    ct.add_argument("--pairs", type=int, default=4000)
    ct.add_argument("--val-images", type=int, default=1000)
    ct.add_argument("--noise", type=float, default=0.5)
    ct.add_argument("--shard-size", type=int, default=500)
    ct.add_argument("--epochs", type=int, default=2)
    ct.add_argument("--batch-size", type=int, default=64)
    ct.add_argument("--lr", type=float, default=5e-5)
    ct.add_argument("--workers", type=int, default=1)
    ct.add_argument("--model", default="all-MiniLM-L6-v2")
    ct.add_argument("--methods", action="store_true", help="the methods table: every row (or --rows) over --seeds")
    ct.add_argument("--rows", help="with --methods or --ablation: only these rows (indices or keys, comma-separated)")
    ct.add_argument("--ablation", choices=sorted(ONE_CHANGE),
                    help="one method's variants on this data, one change a row (runs in OUT/NOISE/ablation-METHOD)")
    ct.add_argument("--validate", choices=VALIDATE, default="last",
                    help="evaluate retrieval after every epoch, or once on the last model (default: saves an "
                         "evaluation of 5,000 captions per epoch)")
    method_arguments(ct, seeds="0")
    args = parser.parse_args(argv)
    for name in ("temperature", "estimator_temperature"):
        if getattr(args, name, None) == 0:
            setattr(args, name, None)
    torch.set_num_threads(args.threads)
    {"step-time": step_time, "toy": toy, "methods": methods_table, "ablation": ablation_table,
     "coco-text": coco_text}[args.table](args)


if __name__ == "__main__":
    sys.exit(main())
