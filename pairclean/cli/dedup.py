"""`pairclean dedup`."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

import pairclean.cli.options as options
from pairclean.cli.app import announce, app, console
from pairclean.cli.progress import RichProgress
from pairclean.cli.terminal import print_table
from pairclean.dedup.defaults import DEFAULT_THRESHOLD
from pairclean.errors import UserError


def summary_table(result) -> Table:
    s = result.summary
    table = Table(title=f"pairclean dedup -> {result.out}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("rows (usable vectors)", f"{s.rows:,} ({s.usable:,})")
    table.add_row("k-means clusters", f"{s.clusters:,}")
    table.add_row("duplicate groups (rows in them)", f"{s.duplicate_groups:,} ({s.in_groups:,})")
    table.add_row("removed (kept = false)", f"{s.removed:,} ({s.share_removed:.2%})")
    if s.scores_join:
        table.add_row("scores joined on (rows with a score)", f"{s.scores_join} ({s.scored_rows:,})")
    if result.already_complete:
        table.add_row("status", "already complete: nothing was done")
    elif s.seconds:
        table.add_row("time", ", ".join(f"{k} {v:.1f} s" for k, v in s.seconds.items())
                      + (" (resumed run)" if result.resumed else ""))
    return table


@app.command("dedup")
def dedup_command(
    source: List[str] = typer.Argument(..., metavar="EMBEDDINGS", help="Saved embeddings: a clip-retrieval layout directory "
                                       "(img_emb/, text_emb/, metadata/; `pairclean score --save-embeddings` writes one), "
                                       "LEFT.npy RIGHT.npy, or DataComp's metadata/ (.npz beside .parquet)."),
    out: str = typer.Option(..., "--out", "-o", metavar="PATH", help="Dedup Parquet to write (a path or an object-store URL): key, shard, index, cluster, group_id, "
                                                     "group_size, kept, nearest_key/shard/index, nearest_sim."),
    scores: Optional[str] = typer.Option(None, "--scores", "-s", metavar="PATH", help="Scores Parquet of these pairs: --keep cleanest keeps the "
                                                                       "copy with the highest sim_debiased."),
    side: str = typer.Option("image", help="Duplicates by the image side (left vectors), the text side (right), or both."),
    threshold: float = typer.Option(DEFAULT_THRESHOLD, help="Duplicates: cosine above this (SemDeDup's eps = 1 - threshold)."),
    keep: str = typer.Option("cleanest", help="Which copy of a group is kept: cleanest (highest sim_debiased), "
                                              "semdedup (SemDeDup's: farthest from the centroid), random."),
    clusters: Optional[int] = typer.Option(None, help="k-means clusters (default: the square root of the rows)."),
    sample_per_cluster: int = typer.Option(40, help="k-means is trained on clusters x this many sampled rows."),
    iterations: int = typer.Option(20, help="k-means iterations."),
    seed: int = typer.Option(0, help="Seed of the k-means sample and initialisation (and of --keep random)."),
    backend: str = typer.Option("auto", help="k-means: auto (faiss if installed), faiss, or torch."),
    threads: int = typer.Option(0, help="torch threads (0: torch's default; 1 is faster on a busy machine)."),
    group_rows: int = typer.Option(65536, help="Clusters are handed out (to torchrun ranks) and committed in groups of at least this many rows."),
    layout: str = typer.Option("auto", help="The embeddings' layout: auto, clip-retrieval, numpy or datacomp-npz."),
    left_emb_field: Optional[str] = typer.Option(None, help="DataComp .npz: the image embeddings' array (default b32_img; l14_img for ViT-L/14)."),
    right_emb_field: Optional[str] = typer.Option(None, help="DataComp .npz: the text embeddings' array (default b32_txt)."),
    keys: Optional[str] = typer.Option(None, help="LEFT.npy RIGHT.npy input: Parquet file with one key per row."),
    key_field: Optional[str] = typer.Option(None, help="Metadata column holding the key (default key, else image_path; uid for DataComp)."),
    overwrite: bool = typer.Option(False, help="Replace an existing output (and discard an unfinished run)."),
    resume: bool = typer.Option(False, help="Continue an unfinished run, failing if there is none (re-running resumes anyway)."),
    allow_other_dataset: options.AllowOtherDataset = False,
) -> None:
    """Semantic deduplication (SemDeDup) of saved embeddings, keeping the copy whose caption matches best."""
    from pairclean.data.embeddings import open_embeddings
    from pairclean.dedup.run import DedupConfig, dedup
    from pairclean.scorefile.contract import is_scores_file

    if given := next((s for s in source if is_scores_file(s)), None):
        raise UserError(f"{given} is a scores file: dedup reads the embeddings a scoring run saved. Score with "
                        f"`pairclean score ... --save-embeddings emb/`, then `pairclean dedup emb/ --scores {given} "
                        "--out dedup.parquet`")

    cfg = DedupConfig(side=side, threshold=threshold, keep=keep, clusters=clusters, sample_per_cluster=sample_per_cluster,
                      iterations=iterations, seed=seed, backend=backend, threads=threads, group_rows=group_rows, overwrite=overwrite,
                      resume=resume, allow_other_dataset=allow_other_dataset, progress=RichProgress(console))
    spec = open_embeddings(source, layout, left_field=left_emb_field, right_field=right_emb_field, key_field=key_field,
                           keys=keys)
    announce(spec)
    result = dedup(spec, out, scores, cfg)  # the run guards `out` against every input, the names given included
    if result.summary:  # under torchrun only rank 0 writes and reports
        print_table(console, summary_table(result))
