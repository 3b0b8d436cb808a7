"""`pairclean score`."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

import pairclean.cli.options as options
from pairclean.cli.app import announce, app, console
from pairclean.cli.progress import RichProgress
from pairclean.cli.terminal import print_table
from pairclean.errors import UserError
from pairclean.scores.rules import DEFAULT_RULES, REGISTRY

RULE_HELP = "; ".join(f"{name}" + (f" ({', '.join(cls.OPTIONS)})" if cls.OPTIONS else "") + f": {cls.__doc__.split(chr(10))[0].rstrip('.')}"
                      for name, cls in REGISTRY.items() if name not in DEFAULT_RULES)


SHORT_SOURCE = 12  # "computed", "cache", "resumed": longer sources go under the table, which they would widen


def beta_source_line(result) -> str | None:
    """Where beta came from, as a line under the summary table when it is too long for a cell."""
    source = (result.summary.beta_source if result.summary else None) or ""
    return None if result.already_complete or len(source) <= SHORT_SOURCE else f"beta: {source}"


def print_summary(result) -> None:
    print_table(console, summary_table(result))
    if line := beta_source_line(result):
        console.print(line, soft_wrap=True)


def summary_table(result) -> Table:
    s = result.summary
    table = Table(title=f"pairclean score -> {result.out}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("pairs (= scored + errors)", f"{s.pairs:,}")
    table.add_row("scored", f"{s.scored:,}")
    table.add_row("errors", f"{s.errors:,}")
    if s.unit_failures:
        table.add_row("failed shards", f"{len(s.unit_failures)} (their rows read before the failure are counted; "
                                       f"reasons in {result.out.stem}.run.json)")
    std = f" ± {s.beta_std:.4f}" if s.beta_std is not None else ""
    table.add_row(f"beta ({s.beta_mode}, K={s.beta_k})", f"{s.beta:.4f}{std}")
    if s.random_pairing_share is not None:  # not all noise: a caption of a similar item is not counted
        table.add_row("pairs like random pairings (est., 95%)",
                      f"{s.random_pairing_share:.1%} [{s.random_pairing_share_low:.1%}, "
                      f"{s.random_pairing_share_high:.1%}]")
    for rule in s.rules:
        table.add_row(f"flagged by {rule.label} rule ({rule.noisy_if})", f"{rule.share_flagged:.1%}")
    if result.already_complete:
        table.add_row("status", "already complete: nothing was scored")
    else:
        table.add_row("throughput", f"{result.pairs_per_second:,.1f} pairs/s" + (" (resumed run)" if result.resumed else ""))
        source = s.beta_source if len(s.beta_source or "") <= SHORT_SOURCE else "see below"
        table.add_row("time: beta / scoring", f"{s.beta_seconds:.1f} s ({source}) / {s.scoring_seconds:.1f} s")
        if s.embeddings_dir:
            table.add_row("embeddings saved", f"{s.embeddings_saved:,} pairs, {s.embedding_bytes / 1e6:,.1f} MB "
                                              f"-> {s.embeddings_dir}")
        if s.batches:
            table.add_row("batches", f"{s.batches:,} ({s.full_batches:,} full, mean fill {s.mean_batch_fill:.0%})")
        if len(by_rank := result.provenance.units_by_rank or {}) > 1:
            table.add_row("units scored by rank", ", ".join(f"{r}: {n}" for r, n in by_rank.items()))
    return table


@app.command("score")
@options.with_dataset
def score_command(
    source: options.Source,
    out: Path = typer.Option(..., "--out", "-o", help="Scores Parquet to write."),
    model: Optional[str] = typer.Option(None, help="open_clip model name, hf-hub:ORG/REPO, or pairclean tiny config "
                                                   "(default ViT-B-32); sentence-transformers: name or local directory "
                                                   "(default all-MiniLM-L6-v2)."),
    backend: options.Backend = "auto",
    pretrained: options.Pretrained = None,
    dataset: options.DatasetOptions = options.GIVEN,
    device: options.Device = "auto",
    precision: options.Precision = "fp32",
    decode: options.Decode = "fast",
    compile: options.Compile = False,
    beta_cache: options.BetaCache = True,
    batch_size: int = typer.Option(256, help="Pairs per forward pass."),
    workers: int = typer.Option(2, help="DataLoader workers decoding and tokenising."),
    beta_mode: options.BetaMode = "random-inputs",
    beta: Optional[float] = typer.Option(None, help="beta value for --beta-mode fixed."),
    beta_k: options.BetaK = 1024,
    weight_fn: str = typer.Option("cubic", help="cubic, linear, cosine, official."),
    seed: int = typer.Option(0, help="Seed for beta's random inputs and the GMM."),
    gmm_sample: int = typer.Option(1_000_000, help="Fit the GMM (and every decision rule) on at most this many similarities."),
    rule: Optional[List[str]] = typer.Option(None, "--rule", metavar="NAME[:KEY=VALUE]", help="Also decide with this rule, NAME[:key=value,...] "
                                             "(repeatable; beta and gmm always run): " + RULE_HELP),
    max_error_share: Optional[float] = typer.Option(None, help="Fail the run, writing no scores file, when more than this "
                                                    "share of the pairs are error rows (a run where every pair is one always fails)."),
    from_embeddings: bool = typer.Option(False, "--from-embeddings", help="SHARDS hold precomputed embeddings (clip-retrieval output "
                                         "directory, LEFT.npy RIGHT.npy, DataComp's metadata/ (.npz), or Parquet with two "
                                         "embedding columns): no model is run."),
    embedding_layout: str = typer.Option("auto", help="--from-embeddings: auto, clip-retrieval, numpy, datacomp-npz or parquet-embeddings."),
    left_emb_field: Optional[str] = typer.Option(None, help="--from-embeddings: the left embeddings' column or array "
                                                 "(default left_emb for Parquet, b32_img for DataComp: l14_img for ViT-L/14)."),
    right_emb_field: Optional[str] = typer.Option(None, help="--from-embeddings: the right embeddings' column or array "
                                                  "(default right_emb for Parquet, b32_txt for DataComp)."),
    keys: Optional[str] = typer.Option(None, help="--from-embeddings, numpy layout: Parquet file with one key per row (--key-field names the column)."),
    random_embeddings: Optional[List[str]] = typer.Option(None, help="--from-embeddings: embeddings of random inputs from the same model, "
                                                          "in any of the layouts (repeat for two .npy files); beta = their mean cross cosine."),
    save_embeddings: Optional[Path] = typer.Option(None, help="Also write every pair's embeddings to this directory in clip-retrieval's "
                                                   "layout (img_emb/, text_emb/, metadata/ with key, shard, index) with the model's provenance: "
                                                   "`pairclean dedup` and `score --from-embeddings` read it."),
    embeddings_dtype: str = typer.Option("float16", help="--save-embeddings: float16 or float32."),
    overwrite: bool = typer.Option(False, help="Replace an existing output (and discard an unfinished run)."),
    resume: bool = typer.Option(False, help="Continue an unfinished run, failing if there is none (re-running the same command resumes anyway)."),
) -> None:
    """Score every pair: cosine, cone bias beta, OSA weight, GMM p_clean -> Parquet."""
    from pairclean.ops.guard import open_output
    from pairclean.scoring.model import ScoreConfig, score

    rules = (*DEFAULT_RULES, *(rule or ()))
    if from_embeddings:
        if save_embeddings is not None:
            raise UserError("--save-embeddings writes the embeddings a model computes; --from-embeddings runs no model")
        from pairclean.data.formats.embeddings import open_embeddings
        from pairclean.scoring.embeddings import EmbeddingScoreConfig, score_embeddings

        spec = open_embeddings(source, embedding_layout, dataset.pair, left_emb_field, right_emb_field,
                               dataset.fields.get("key"), keys)
        rand = open_embeddings(random_embeddings, left_field=left_emb_field, right_field=right_emb_field) \
            if random_embeddings else None
        announce(spec)
        target = open_output(out, source, "out", overwrite=None)  # the names given; the run adds the files it reads
        result = score_embeddings(spec, target, EmbeddingScoreConfig(
            beta_mode=beta_mode, beta=beta, random_embeddings=rand, weight_fn=weight_fn, seed=seed,
            gmm_sample=gmm_sample, rules=rules, max_error_share=max_error_share, overwrite=overwrite, resume=resume,
            progress=RichProgress(console)))
        print_summary(result)
        return
    spec = dataset.spec(source)
    target = open_output(out, [*source, *spec.shards], "out", overwrite=None)  # the run adds the files it reads
    if save_embeddings is not None:  # against the names given too (score() checks it against the files it reads)
        open_output(save_embeddings, [*source, *spec.shards], "save_embeddings", kind="directory", overwrite=None)
    cfg = ScoreConfig(model=model, backend=backend, pretrained=pretrained,
                      device=device, precision=precision, decode=decode,
                      batch_size=batch_size, workers=workers, beta_mode=beta_mode, beta=beta, beta_k=beta_k,
                      weight_fn=weight_fn, seed=seed, gmm_sample=gmm_sample, rules=rules,
                      max_error_share=max_error_share, overwrite=overwrite, resume=resume,
                      compile=compile, beta_cache=beta_cache, save_embeddings=save_embeddings,
                      embeddings_dtype=embeddings_dtype, progress=RichProgress(console))
    announce(spec)
    result = score(spec, target, cfg)
    if result.summary:  # under torchrun only rank 0 finalizes and reports
        print_summary(result)
