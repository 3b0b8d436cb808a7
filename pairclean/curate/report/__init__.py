"""`pairclean report`: one self-contained HTML page to look at scores before choosing a threshold.

Everything is computed by DuckDB over the scores file (`stats`: histogram counts, per-shard
statistics, the lowest and highest pairs), so the report costs one scan per section, not the
dataset in memory. Figures are matplotlib SVGs (`figures`) and thumbnails JPEGs (`media`: read
from the shards through the dataset reader, only the units that hold gallery pairs), both
embedded as data URIs in the page (`page`: `page.html` and `report.css`): the file can be mailed
or archived and still shows everything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pairclean.curate.report.media import fetch_media, media_dataset
from pairclean.curate.report.page import render_page
from pairclean.curate.report.stats import gather
from pairclean.config import at_least, declare, within
from pairclean.data.spec import Fields
from pairclean.errors import UserError
from pairclean.ops.guard import open_output
from pairclean.scorefile.contract import from_embeddings, recorded_inputs, scored_pairs
from pairclean.scorefile.db import ScoresDB

MAX_BINS = 1000  # a histogram bar per bin: more is unreadable and grows the page without bound


@dataclass
class ReportResult:
    out: Path
    pairs: int
    gallery_pairs: int
    thumbnails: int
    media_note: str | None


@declare(gallery=at_least(0), contrast=at_least(0), thumb=within(1, 4096), bins=within(2, MAX_BINS),
         max_shard_rows=at_least(0))
def build_report(scores: str | Path, out: str | Path, shards: list[str] | None = None,
                 truth: str | Path | None = None, gallery: int = 24, contrast: int = 8, thumb: int = 224,
                 bins: int = 60, max_shard_rows: int = 40, title: str | None = None, fields: Fields | None = None,
                 overwrite: bool = False, allow_other_dataset: bool = False, **dataset_options) -> ReportResult:
    """Write the HTML report for a scores file; thumbnails come from `shards`, else the dataset the
    scores recorded (`fields` and `dataset_options`: format, split, image_root, pair override how it
    is read), which must still be the dataset scored (`allow_other_dataset` waives its fingerprints)."""
    scores = Path(scores)
    target = open_output(out, [*recorded_inputs(scores), truth, *(shards or [])], overwrite=overwrite)
    out = target.path
    with ScoresDB(scores, truth=truth) as db:
        prov = db.provenance
        if prov is None:
            raise UserError(f"{scores} has no pairclean provenance (not written by pairclean score?)")
        stats = gather(db, prov, truth is not None, bins, gallery, contrast)
        dataset, media_note = media_dataset(prov, shards, fields, **dataset_options)
        if dataset is not None and from_embeddings(prov):
            db.check_unique_keys()
    if dataset is not None:  # the dataset read for the thumbnails is an input too
        target = open_output(target, dataset.input_paths())
    media = fetch_media(dataset, stats.lowest + stats.highest, thumb, from_embeddings(prov), scored_pairs(prov),
                        allow_other_dataset) if dataset is not None else {}
    page = render_page(scores, prov, stats, media, media_note, title or f"pairclean report · {scores.name}",
                       max_shard_rows)
    with target.write() as tmp:
        tmp.write_text(page, encoding="utf-8")
    return ReportResult(out=out, pairs=stats.summary.pairs, gallery_pairs=len(stats.lowest) + len(stats.highest),
                        thumbnails=sum(1 for m in media.values() for src in m.images if src), media_note=media_note)
