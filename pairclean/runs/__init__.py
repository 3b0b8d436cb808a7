"""The resumable run, written once: what scoring and dedup share (and training's pinned settings).

    engine.py  `open_run`: the output guard (once, companions included), the run's pinned settings
               and units, fresh / resumed / already finished, commits with their rank and the
               unit's file fingerprint, the run's part of the provenance, the output written in place
    store.py   `PartStore`: the parts directory beside the output (lock, settings.json, units.json,
               run.json, one part + commit record per unit, named stage records), `settings_changes`
    claims.py  `GroupClaims`: work handed to whichever process (rank, worker) claims it first

A run's owner keeps only what is its own: scoring its beta, packing and finalize
(`scoring.run`), dedup its stages (`dedup.run`).
"""

from pairclean.runs.claims import GroupClaims
from pairclean.runs.engine import Run, RunIdentity, Started, by_rank, open_run
from pairclean.runs.store import (PartStore, ReadBack, RunStart, WrittenBy, parts_dir_for, settings_changes,
                                  settings_digest)

__all__ = ["GroupClaims", "PartStore", "ReadBack", "Run", "RunIdentity", "RunStart", "Started", "WrittenBy", "by_rank", "open_run",
           "parts_dir_for", "settings_changes", "settings_digest"]
