"""Semantic deduplication of saved embeddings (SemDeDup), keeping from each group of duplicates the
pair whose caption matches its image best: `dedup(source, out, scores, DedupConfig(...))`.

The run module (torch, faiss) loads on first use, so the CLI can name the default threshold
(`defaults.py`) without starting torch (the demo fixes torch's CPU arithmetic before torch starts)."""

from pairclean.dedup.defaults import DEFAULT_THRESHOLD

__all__ = ["DEFAULT_THRESHOLD", "DedupConfig", "DedupResult", "dedup"]


def __getattr__(name: str):
    if name in ("DedupConfig", "DedupResult", "dedup"):
        from pairclean.dedup import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
