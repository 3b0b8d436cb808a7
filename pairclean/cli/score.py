"""`pairclean score`: a model over shards, or (`--from-embeddings`, a mode with its own options)
precomputed embeddings."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table
from typing_extensions import Annotated

import pairclean.cli.options as options
from pairclean.cli.app import App, ModalCommand, Mode, announce, app, console, panels
from pairclean.cli.progress import RichProgress
from pairclean.cli.terminal import print_table
from pairclean.scorefile.rules import DEFAULT_RULES, REGISTRY

RULE_HELP = "; ".join(f"{name}" + (f" ({', '.join(cls.OPTIONS)})" if cls.OPTIONS else "") + f": {cls.__doc__.split(chr(10))[0].rstrip('.')}"
                      for name, cls in REGISTRY.items() if name not in DEFAULT_RULES)


SHORT_SOURCE = 12  # "computed", "cache", "resumed": longer sources go under the table, which they would widen


def beta_source_line(result) -> str | None:
    """Where beta came from, as a line under the summary table when it is too long for a cell."""
    source = (result.summary.beta_source if result.summary else None) or ""
    return None if result.already_complete or len(source) <= SHORT_SOURCE else f"beta: {source}"


def beta_label(summary) -> str:
    """How beta was had, in the summary's words: `beta (random-inputs, K=1024)`, `beta (shuffled,
    16 pairs)`, `beta (fixed)`."""
    if summary.beta_mode == "random-inputs":
        return f"beta (random-inputs, K={summary.beta_k})"
    if summary.beta_mode == "shuffled" and summary.beta_k:
        return f"beta (shuffled, {summary.beta_k:,} pairs)"
    return f"beta ({summary.beta_mode})"


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
    table.add_row(beta_label(s), f"{s.beta:.4f}{std}")
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
            workers = f"; {s.workers} DataLoader workers" if s.workers is not None else ""
            table.add_row("batches", f"{s.batches:,} ({s.full_batches:,} full, mean fill {s.mean_batch_fill:.0%}){workers}")
        if len(by_rank := result.provenance.units_by_rank or {}) > 1:
            table.add_row("units scored by rank", ", ".join(f"{r}: {n}" for r, n in by_rank.items()))
        if by_node := result.provenance.units_by_node:
            lost = f"; {result.provenance.workers_lost} worker(s) lost" if result.provenance.workers_lost else ""
            counts = sorted(by_node.values())
            spread = f"{counts[0]:,}" if counts[0] == counts[-1] else f"{counts[0]:,} to {counts[-1]:,}"
            table.add_row("units scored on Ray", f"{len(counts)} node(s), {spread} units each{lost}")
    return table


ScoresOut = Annotated[str, typer.Option("--out", "-o", metavar="PATH", callback=options.file_named,
                                        help="Scores Parquet to write: a path, or an object-store URL "
                                             "(s3://BUCKET/run/scores.parquet, gs://..., any fsspec URL).")]
BetaValue = Annotated[Optional[float], typer.Option("--beta", help="beta value for --beta-mode fixed.")]
WeightFn = Annotated[str, typer.Option(help="cubic, linear, cosine, official.")]
Seed = Annotated[int, typer.Option(help="Seed for beta's random inputs and the GMM.")]
GmmSample = Annotated[int, typer.Option(help="Fit the GMM (and every decision rule) on at most this many similarities.")]
Rules = Annotated[Optional[List[str]], typer.Option(
    "--rule", metavar="NAME[:KEY=VALUE]", help="Also decide with this rule, NAME[:key=value,...] (repeatable; beta and "
                                               "gmm always run): " + RULE_HELP)]
MaxErrorShare = Annotated[Optional[float], typer.Option(
    help="Fail the run, writing no scores file, when more than this share of the pairs are error rows (a run where "
         "every pair is one always fails).")]
Overwrite = Annotated[bool, typer.Option(help="Replace an existing output (and discard an unfinished run).")]
Resume = Annotated[bool, typer.Option(help="Continue an unfinished run, failing if there is none (re-running the same "
                                           "command resumes anyway).")]
FROM_EMBEDDINGS = "--from-embeddings"

# `pairclean score EMBEDDINGS --from-embeddings`: a mode of `score` with its own options (cli.app.ModalCommand).
embeddings_mode = App()


@embeddings_mode.command("score")
def score_embeddings_command(
    source: List[str] = typer.Argument(..., metavar="EMBEDDINGS", help="Precomputed embeddings: a clip-retrieval "
                                       "output directory, LEFT.npy RIGHT.npy, DataComp's metadata/ (.npz), or Parquet "
                                       "with two embedding columns."),
    out: ScoresOut = ...,
    pair: options.Pair = None,
    embedding_layout: str = typer.Option("auto", help="auto, clip-retrieval, numpy, datacomp-npz or parquet-embeddings."),
    left_emb_field: Optional[str] = typer.Option(None, help="The left embeddings' column or array (default left_emb for "
                                                 "Parquet, b32_img for DataComp: l14_img for ViT-L/14)."),
    right_emb_field: Optional[str] = typer.Option(None, help="The right embeddings' column or array (default right_emb "
                                                  "for Parquet, b32_txt for DataComp)."),
    key_field: Optional[str] = typer.Option(None, help="The key column of the metadata, keys file or Parquet (default "
                                            "key, else image_path; uid for DataComp)."),
    keys: Optional[str] = typer.Option(None, help="Numpy layout: Parquet file with one key per row (--key-field names "
                                       "the column)."),
    random_embeddings: Optional[List[str]] = typer.Option(None, help="Embeddings of random inputs from the same model, "
                                                          "in any of the layouts (repeat for two .npy files); beta = "
                                                          "their mean cross cosine."),
    beta_mode: options.BetaMode = "random-inputs",
    beta: BetaValue = None,
    weight_fn: WeightFn = "cubic",
    seed: Seed = 0,
    gmm_sample: GmmSample = 1_000_000,
    rule: Rules = None,
    max_error_share: MaxErrorShare = None,
    overwrite: Overwrite = False,
    resume: Resume = False,
) -> None:
    """Score precomputed embedding pairs: cosine, beta, OSA weight, GMM p_clean -> Parquet; no model is run."""
    from pairclean.data.embeddings import open_embeddings
    from pairclean.scoring.embeddings import EmbeddingScoreConfig, score_embeddings

    spec = open_embeddings(source, embedding_layout, pair, left_emb_field, right_emb_field, key_field, keys)
    rand = open_embeddings(random_embeddings, left_field=left_emb_field, right_field=right_emb_field) \
        if random_embeddings else None
    announce(spec)
    result = score_embeddings(spec, out, EmbeddingScoreConfig(
        beta_mode=beta_mode, beta=beta, random_embeddings=rand, weight_fn=weight_fn, seed=seed,
        gmm_sample=gmm_sample, rules=(*DEFAULT_RULES, *(rule or ())), max_error_share=max_error_share,
        overwrite=overwrite, resume=resume, progress=RichProgress(console)))
    print_summary(result)


@lru_cache(maxsize=1)
def _embeddings_command():
    return typer.main.get_command(embeddings_mode)


class _ScoreCommand(ModalCommand):
    def modes(self) -> tuple[Mode, ...]:
        return (Mode(FROM_EMBEDDINGS, _embeddings_command(), "SHARDS hold precomputed embeddings (clip-retrieval "
                     "output directory, LEFT.npy RIGHT.npy, DataComp's metadata/ (.npz), or Parquet with two embedding "
                     "columns): no model is run."),)


# `score --help` in the order of the work: what is scored, by which model, into what; then the
# decisions; then how fast; then reading data detection does not take as it should.
SCORE_PANELS = (
    ("What to score, with which model, into what", ("--out", "--pair", "--model", "--pretrained", "--backend",
                                                    "--overwrite", "--resume")),
    ("Decisions: beta, the rules, the weights", ("--beta-mode", "--beta-k", "--beta", "--beta-cache", "--rule", "--weight-fn",
                                "--seed", "--gmm-sample", "--max-error-share")),
    ("Performance", ("--device", "--batch-size", "--workers", "--precision", "--decode", "--cpu-decode-share",
                     "--compile")),
    ("Past one machine: a Ray cluster", ("--engine", "--ray-address", "--ray-workers", "--ray-gpus", "--group-units")),
    ("Reading the data (where detection needs help)", ("--input-format", "--split", "--image-root", "--image-field",
                                                       "--image-path-field", "--text-field", "--json-text-key",
                                                       "--key-field", "--text2-field", "--image2-field",
                                                       "--image2-path-field", "--label-field", "--label-template",
                                                       "--allow-pipe")),
    ("Embeddings for dedup and rescoring", ("--save-embeddings", "--embeddings-dtype")),
)


@app.command("score", cls=_ScoreCommand)
@panels(*SCORE_PANELS)
@options.dataset_options
def score_command(
    ctx: typer.Context,
    source: options.Source,
    out: ScoresOut = ...,
    model: Optional[str] = typer.Option(None, help="open_clip model name, hf-hub:ORG/REPO, or pairclean tiny config "
                                                   "(default ViT-B-32); sentence-transformers: name or local directory "
                                                   "(default all-MiniLM-L6-v2)."),
    backend: options.Backend = "auto",
    pretrained: options.Pretrained = None,
    device: options.Device = "auto",
    precision: options.Precision = "fp32",
    decode: options.Decode = "fast",
    cpu_decode_share: options.CpuDecodeShare = 0.0,
    compile: options.Compile = False,
    beta_cache: options.BetaCache = True,
    batch_size: int = typer.Option(256, help="Pairs per forward pass."),
    workers: options.Workers = "auto",
    beta_mode: options.BetaMode = "random-inputs",
    beta: BetaValue = None,
    beta_k: options.BetaK = 1024,
    weight_fn: WeightFn = "cubic",
    seed: Seed = 0,
    gmm_sample: GmmSample = 1_000_000,
    rule: Rules = None,
    max_error_share: MaxErrorShare = None,
    save_embeddings: Optional[str] = typer.Option(None, metavar="DIR", help="Also write every pair's embeddings to this directory (or object-store URL) in clip-retrieval's "
                                                   "layout (img_emb/, text_emb/, metadata/ with key, shard, index) with the model's provenance: "
                                                   "`pairclean dedup` and `score --from-embeddings` read it."),
    embeddings_dtype: str = typer.Option("float16", help="--save-embeddings: float16 or float32."),
    engine: str = typer.Option("local", help="Where the units are scored: local (this process, or torchrun's ranks) "
                               "or ray (the workers of a Ray cluster; pip install 'pairclean[ray]'; docs/distributed.md)."),
    ray_address: Optional[str] = typer.Option(None, metavar="HOST:PORT", help="--engine ray: the cluster (default: "
                                              "$RAY_ADDRESS, else a Ray instance started on this machine)."),
    ray_workers: Optional[int] = typer.Option(None, metavar="N", help="--engine ray: scoring workers (default: one per "
                                              "GPU, or one per node on a cluster without GPUs)."),
    ray_gpus: Optional[float] = typer.Option(None, metavar="F", help="--engine ray: GPUs per worker, a fraction of one "
                                             "for small models (default: 1 where the cluster has GPUs)."),
    group_units: Optional[int] = typer.Option(None, metavar="N", help="Units (shards, row groups) per group of "
                                              "consecutive units whose pairs share batches (default: packed from "
                                              "--batch-size and the readers); pinned by the run."),
    overwrite: Overwrite = False,
    resume: Resume = False,
) -> None:
    """Score every pair: cosine, cone bias beta, OSA weight, GMM p_clean -> Parquet."""
    data = options.dataset_given(ctx).open(source)
    data.check_fields()  # before torch loads: a column or member the data do not hold is named in a second or two
    from pairclean.scoring.model import ScoreConfig, score

    cfg = ScoreConfig(model=model, backend=backend, pretrained=pretrained,
                      device=device, precision=precision, decode=decode, cpu_decode_share=cpu_decode_share,
                      batch_size=batch_size, workers=options.workers_given(workers), beta_mode=beta_mode, beta=beta, beta_k=beta_k,
                      weight_fn=weight_fn, seed=seed, gmm_sample=gmm_sample, rules=(*DEFAULT_RULES, *(rule or ())),
                      max_error_share=max_error_share, overwrite=overwrite, resume=resume,
                      compile=compile, beta_cache=beta_cache, save_embeddings=save_embeddings,
                      embeddings_dtype=embeddings_dtype, engine=engine, ray_address=ray_address,
                      ray_workers=ray_workers, ray_gpus=ray_gpus, group_units=group_units,
                      progress=RichProgress(console))
    announce(data)
    result = score(data, out, cfg)  # the run guards `out` against every input, the names given included
    if result.summary:  # under torchrun only rank 0 finalizes and reports
        print_summary(result)
