"""`pairclean train`: a thin layer over pairclean.train.train."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

import pairclean.cli.options as options
from pairclean.ops.guard import check_output
from pairclean.cli.app import app, console
from pairclean.cli.progress import RichProgress
from pairclean.errors import UserError


def method_and_options(method: Optional[str], weights: Optional[str], scores: Optional[str], filter_sql: Optional[str],
                       online: bool, weight_column: Optional[str], join: Optional[str], on_missing: Optional[str],
                       reduction: Optional[str], online_options: dict, extra: list[str]) -> tuple[str, dict]:
    """The method named by --method, or implied by --weights / --filter / --online; its options."""
    if weights and scores and weights != scores:
        raise UserError("--weights FILE already names the scores file; drop --scores")
    if online and (weights or scores or filter_sql):
        raise UserError("--online computes weights in the loop: it does not take --weights, --scores or --filter")
    scores = weights or scores
    if method is None:
        if online:
            method = "osa-online"
        elif weights:
            method = "osa-weights"
        elif filter_sql:
            method = "filter"
        else:
            method = "plain"
    if filter_sql and not scores:
        raise UserError("--filter needs the scores to evaluate it on: --scores FILE (or --weights FILE)")
    chosen: dict = {}
    if method in ("osa-weights", "filter"):
        chosen.update({"scores": scores, "filter": filter_sql, "join": join, "on_missing": on_missing})
    if method == "osa-weights":
        chosen.update({"column": weight_column, "reduction": reduction})
    if method == "osa-online":
        chosen.update({**online_options, "reduction": reduction})
    chosen = {k: v for k, v in chosen.items() if v is not None}
    for item in extra:
        if "=" not in item:
            raise UserError(f"--method-option takes key=value, not {item!r}")
        key, value = item.split("=", 1)
        chosen[key.strip().replace("-", "_")] = value
    return method, chosen


def epochs_table(result) -> Table:
    table = Table(title=f"pairclean train -> {result.run_dir}")
    for name in ("epoch", "train loss", "pairs/s", "i2t R@1", "t2i R@1", "rSum", "seconds"):
        table.add_column(name, justify="right")
    for rec in result.epochs:
        def val(key):
            return f"{rec[key]:.1f}" if rec.get(key) is not None else "-"
        mark = " *" if rec["epoch"] == result.best_epoch else ""
        table.add_row(f"{rec['epoch']}{mark}", f"{rec['train_loss']:.4f}", f"{rec['pairs_per_second']:,.1f}",
                      val("val_i2t_r1"), val("val_t2i_r1"), val("val_rsum"), f"{rec['seconds']:.1f}")
    return table


def list_method_options(value: Optional[List[str]]):
    """`--method-option help`: every method with its options and their defaults, then exit."""
    if not value or "help" not in value:
        return value
    import dataclasses

    from pairclean.train import METHODS

    table = Table(title="pairclean train --method NAME --method-option key=value")
    for column in ("method", "what it does", "options (default)"):
        table.add_column(column)
    for name, cls in sorted(METHODS.items()):
        options = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls.Options)) or "-"
        table.add_row(name, (cls.__doc__ or "").strip().splitlines()[0], options)
    console.print(table)
    raise typer.Exit()


@app.command("train")
@options.with_dataset
def train_command(
    source: options.Source,
    out: Path = typer.Option(..., "--out", "-o", help="Run directory (checkpoints, metrics.jsonl, run.json)."),
    val: Optional[List[str]] = typer.Option(None, "--val", help="Validation pairs: R@K and rSum each epoch, best checkpoint by rSum."),
    model: str = typer.Option("ViT-B-32", help="open_clip model name (or a pairclean tiny config), or a sentence-transformers directory / all-MiniLM-L6-v2."),
    pretrained: options.Pretrained = "openai",
    backend: str = typer.Option("auto", help="auto, open_clip, or sentence-transformers."),
    dataset: options.DatasetOptions = options.GIVEN,
    weights: Optional[str] = typer.Option(None, help="Scores Parquet: weight each pair's loss by a column of it (method osa-weights)."),
    weight_column: Optional[str] = typer.Option(None, help="Column of the scores used as weight (default weight_norm, the OSA weight in [0, 1])."),
    scores: Optional[str] = typer.Option(None, help="Scores Parquet for --filter without weighting."),
    filter_sql: Optional[str] = typer.Option(None, "--filter", help="DuckDB predicate over the scores; pairs where it is not true are dropped."),
    join: Optional[str] = typer.Option(None, help="Join scores to shards by auto, shard-index or key."),
    on_missing: Optional[str] = typer.Option(None, help="Pairs missing from the scores: error (default), drop, or keep (weight 1)."),
    online: bool = typer.Option(False, help="OSA weights computed in the loop by a frozen estimator (method osa-online)."),
    estimator_model: Optional[str] = typer.Option(None, help="--online estimator (default: a frozen copy of the model before training)."),
    estimator_pretrained: Optional[str] = typer.Option(None, help="--online estimator weights: tag, path, or none."),
    weight_fn: Optional[str] = typer.Option(None, help="--online weight function: cubic, linear, cosine, official."),
    beta_k: Optional[int] = typer.Option(None, help="--online: K random inputs per side for beta."),
    reduction: Optional[str] = typer.Option(None, help="Weighted loss: mean (sum w*l / B, the paper) or weight-sum (sum w*l / sum w)."),
    method: Optional[str] = typer.Option(None, help="Training method by name (plain, osa-weights, filter, osa-online, sdd, gsc, ...)."),
    method_option: Optional[List[str]] = typer.Option(None, callback=list_method_options, is_eager=True,
                                                      help="Method option key=value (repeatable); 'help' lists every "
                                                           "method's options and defaults."),
    epochs: int = typer.Option(5, help="Passes over the training data."),
    batch_size: int = typer.Option(256, help="Pairs per step (in-batch negatives)."),
    lr: float = typer.Option(5e-6, help="Peak AdamW learning rate."),
    weight_decay: float = typer.Option(0.2, help="AdamW weight decay (not on gains, biases, logit scale)."),
    warmup_steps: int = typer.Option(500, help="Linear warm-up steps before the cosine decay."),
    min_lr_ratio: float = typer.Option(0.0, help="The cosine ends at lr x this."),
    grad_clip: Optional[float] = typer.Option(1.0, help="Max gradient norm (0 disables)."),
    temperature: Optional[float] = typer.Option(None, help="Fixed softmax temperature (default: open_clip learns it; sentence-transformers 0.05)."),
    device: options.Device = "auto",
    precision: options.Precision = "fp32",
    workers: int = typer.Option(2, help="DataLoader workers reading, decoding and tokenising."),
    shuffle_buffer: int = typer.Option(1000, help="Pairs in each worker's shuffle buffer."),
    val_batch_size: int = typer.Option(256, help="Pairs per forward pass during validation."),
    log_every: int = typer.Option(10, help="Write a step line to metrics.jsonl every N steps."),
    diagnostics: bool = typer.Option(True, help="Write per-pair loss/weight Parquet per epoch."),
    seed: int = typer.Option(0, help="Seed for initialisation, data order and beta."),
    resume: bool = typer.Option(False, help="Continue the run in --out from its last finished epoch."),
    overwrite: bool = typer.Option(False, help="Replace the run in --out."),
) -> None:
    """Train a dual encoder on (reweighted or filtered) pairs: weighted symmetric InfoNCE."""
    check_output(out, [*source, *(val or [])])  # the directories named; the files read are checked by train()
    online_options = {"estimator_model": estimator_model, "estimator_pretrained": estimator_pretrained,
                      "weight_fn": weight_fn, "beta_k": beta_k}
    if not online and any(v is not None for v in online_options.values()):
        raise UserError("--estimator-model, --estimator-pretrained, --weight-fn and --beta-k go with --online")
    name, method_options = method_and_options(method, weights, scores, filter_sql, online, weight_column, join, on_missing,
                                       reduction, online_options, method_option or [])
    from pairclean.train import TrainConfig, train

    cfg = TrainConfig(model=model, pretrained=pretrained, backend=backend, device=device, precision=precision,
                      epochs=epochs, batch_size=batch_size, lr=lr, weight_decay=weight_decay,
                      warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio, grad_clip=grad_clip or None,
                      temperature=temperature, method=name, method_options=method_options, workers=workers,
                      shuffle_buffer=shuffle_buffer, val_batch_size=val_batch_size, log_every=log_every,
                      diagnostics=diagnostics, seed=seed, resume=resume, overwrite=overwrite, progress=RichProgress(console))
    spec = dataset.spec(source)
    val_spec = dataset.spec(val, pair=spec.pair) if val else None
    result = train(spec, out, cfg, val=val_spec)
    from pairclean.ops import distributed

    if not distributed.is_main():  # under torchrun rank 0 reports
        return
    console.print(epochs_table(result))
    if result.best_model is not None:
        console.print(f"best: epoch {result.best_epoch}, rSum {result.best_rsum:.1f} -> {result.best_model}")
    console.print(f"last: {result.last_model}")
