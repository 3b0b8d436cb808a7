"""`pairclean score`."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

from pairclean.cli import app, console


def summary_table(result) -> Table:
    s = result.summary
    table = Table(title=f"pairclean score -> {result.out}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("pairs (= scored + errors)", f"{s['pairs']:,}")
    table.add_row("scored", f"{s['scored']:,}")
    table.add_row("errors", f"{s['errors']:,}")
    if s["unit_failures"]:
        table.add_row("failed shards", f"{len(s['unit_failures'])} (their rows read before the failure are counted; "
                                       f"reasons in {result.out.stem}.run.json)")
    std = f" ± {s['beta_std']:.4f}" if s.get("beta_std") is not None else ""
    table.add_row(f"beta ({s['beta_mode']}, K={s['beta_k']})", f"{s['beta']:.4f}{std}")
    table.add_row("flagged by beta rule (s~ <= 0)", f"{s['share_flagged_beta']:.1%}")
    table.add_row("flagged by GMM (p_clean < 0.5)", f"{s['share_flagged_gmm']:.1%}")
    if result.already_complete:
        table.add_row("status", "already complete: nothing was scored")
    else:
        table.add_row("throughput", f"{result.pairs_per_second:,.1f} pairs/s" + (" (resumed run)" if result.resumed else ""))
        table.add_row("time: beta / scoring", f"{s['beta_seconds']:.1f} s ({s['beta_source']}) / {s['scoring_seconds']:.1f} s")
    return table


@app.command("score")
def score_command(
    source: List[str] = typer.Argument(..., help="Shards: directory, glob, brace pattern, list file, Parquet files, or a manifest YAML."),
    out: Path = typer.Option(..., "--out", "-o", help="Scores Parquet to write."),
    model: Optional[str] = typer.Option(None, help="open_clip model name or pairclean tiny config (default ViT-B-32); "
                                                   "sentence-transformers: name or local directory (default all-MiniLM-L6-v2)."),
    backend: str = typer.Option("open_clip", help="Estimator: open_clip (images and text) or sentence-transformers (text-text pairs)."),
    pretrained: str = typer.Option("openai", help="Pretrained tag, local checkpoint path, or 'none' (random init)."),
    pair: Optional[str] = typer.Option(None, help="Pair kind: image-text, text-text, image-label, image-image."),
    device: str = typer.Option("auto", help="auto, cpu, cuda, cuda:1 ..."),
    precision: str = typer.Option("fp32", help="fp32, bf16 (autocast), fp16 (CUDA only), or auto (bf16/fp16 on CUDA, bf16 on CPUs with native bf16, else fp32)."),
    decode: str = typer.Option("fast", help="fast (JPEG draft decode at model size), exact, or gpu (JPEGs decoded on the CUDA device; CPU workers otherwise)."),
    compile: bool = typer.Option(False, "--compile", help="torch.compile the model (first batches slower; falls back to eager if compiling fails)."),
    beta_cache: bool = typer.Option(True, help="Reuse a random-inputs beta computed before for the same weights, K and seed."),
    batch_size: int = typer.Option(256, help="Pairs per forward pass."),
    workers: int = typer.Option(2, help="DataLoader workers decoding and tokenising."),
    beta_mode: str = typer.Option("random-inputs", help="random-inputs, shuffled, or fixed."),
    beta: Optional[float] = typer.Option(None, help="beta value for --beta-mode fixed."),
    beta_k: int = typer.Option(1024, help="K random inputs per side for --beta-mode random-inputs."),
    weight_fn: str = typer.Option("cubic", help="cubic, linear, cosine, official."),
    seed: int = typer.Option(0, help="Seed for beta's random inputs and the GMM."),
    gmm_sample: int = typer.Option(1_000_000, help="Fit the GMM on at most this many similarities."),
    image_field: Optional[str] = typer.Option(None, help="Image member extensions (';'-separated) or Parquet bytes column."),
    image_path_field: Optional[str] = typer.Option(None, help="Parquet column of image paths relative to the file."),
    text_field: Optional[str] = typer.Option(None, help="Caption member extension or Parquet column."),
    json_text_key: Optional[str] = typer.Option(None, help="Caption key inside a json member."),
    key_field: Optional[str] = typer.Option(None, help="Parquet id column."),
    text2_field: Optional[str] = typer.Option(None, help="text-text pairs: second text member or Parquet column."),
    image2_field: Optional[str] = typer.Option(None, help="image-image pairs: second image member extensions or Parquet bytes column."),
    image2_path_field: Optional[str] = typer.Option(None, help="image-image pairs: Parquet column of second-image paths."),
    label_field: Optional[str] = typer.Option(None, help="image-label pairs: label member or Parquet column."),
    label_template: Optional[str] = typer.Option(None, help='image-label pairs: the sentence a label becomes (default "This is a picture of {label}.").'),
    from_embeddings: bool = typer.Option(False, "--from-embeddings", help="SOURCE holds precomputed embeddings (clip-retrieval output "
                                         "directory, LEFT.npy RIGHT.npy, or Parquet with two embedding columns): no model is run."),
    embedding_layout: str = typer.Option("auto", help="--from-embeddings: auto, clip-retrieval, numpy or parquet."),
    left_emb_field: str = typer.Option("left_emb", help="--from-embeddings, Parquet layout: column of the left embeddings."),
    right_emb_field: str = typer.Option("right_emb", help="--from-embeddings, Parquet layout: column of the right embeddings."),
    keys: Optional[str] = typer.Option(None, help="--from-embeddings, numpy layout: Parquet file with one key per row (--key-field names the column)."),
    random_embeddings: Optional[List[str]] = typer.Option(None, help="--from-embeddings: embeddings of random inputs from the same model, "
                                                          "in any of the layouts (repeat for two .npy files); beta = their mean cross cosine."),
    overwrite: bool = typer.Option(False, help="Replace an existing output (and discard an unfinished run)."),
    resume: bool = typer.Option(False, help="Continue an unfinished run, failing if there is none (re-running the same command resumes anyway)."),
    allow_pipe: bool = typer.Option(False, help="Allow `pipe:` shard URLs, which run shell commands."),
) -> None:
    """Score every pair: cosine, cone bias beta, OSA weight, GMM p_clean -> Parquet."""
    from pairclean.backends import check_backend, default_model
    from pairclean.data.manifest import Fields, open_dataset
    from pairclean.scoring.run import ScoreConfig, score

    if from_embeddings:
        from pairclean.scoring.embeddings import EmbeddingScoreConfig, open_embeddings, score_embeddings

        spec = open_embeddings(source, embedding_layout, pair, left_emb_field, right_emb_field, key_field, keys)
        rand = open_embeddings(random_embeddings, left_field=left_emb_field, right_field=right_emb_field) \
            if random_embeddings else None
        result = score_embeddings(spec, out, EmbeddingScoreConfig(
            beta_mode=beta_mode, beta=beta, random_embeddings=rand, weight_fn=weight_fn, seed=seed,
            gmm_sample=gmm_sample, overwrite=overwrite, resume=resume, show_progress=True))
        console.print(summary_table(result))
        return
    overrides = {k: v for k, v in {"image": image_field, "image_path": image_path_field, "text": text_field,
                                   "json_text_key": json_text_key, "key": key_field, "text2": text2_field,
                                   "image2": image2_field, "image2_path": image2_path_field,
                                   "label": label_field}.items() if v is not None}
    spec = open_dataset(source, pair=pair, allow_pipe=allow_pipe, label_template=label_template)
    if overrides:
        spec.fields = Fields(**{**spec.fields.__dict__, **overrides})
    backend = check_backend(backend)
    cfg = ScoreConfig(model=model or default_model(backend), backend=backend, pretrained=pretrained,
                      device=device, precision=precision, decode=decode,
                      batch_size=batch_size, workers=workers, beta_mode=beta_mode, beta=beta, beta_k=beta_k,
                      weight_fn=weight_fn, seed=seed, gmm_sample=gmm_sample, overwrite=overwrite, resume=resume,
                      compile=compile, beta_cache=beta_cache,
                      show_progress=True)
    result = score(spec, out, cfg)
    if result.summary:  # under torchrun only rank 0 finalizes and reports
        console.print(summary_table(result))
