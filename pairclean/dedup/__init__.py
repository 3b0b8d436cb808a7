"""Semantic deduplication of saved embeddings (SemDeDup), keeping from each group of duplicates the
pair whose caption matches its image best: `dedup(source, out, scores, DedupConfig(...))`."""

from pairclean.dedup.run import DedupConfig, DedupResult, dedup

__all__ = ["DedupConfig", "DedupResult", "dedup"]
