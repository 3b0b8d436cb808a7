"""The resumable run, written once: what scoring and dedup share (and training's pinned settings).

    engine.py  `open_run`: the output guard (once, companions included), the run's pinned settings
               and units, fresh / resumed / already finished, commits with their rank and the
               unit's file fingerprint, the run's part of the provenance, the output written in place
    store.py   `PartStore`: the parts directory beside the output (lock, settings.json, units.json,
               run.json, one part + commit record per unit, named stage records), `settings_changes`
    claims.py  `GroupClaims`: work handed to whichever process (rank, worker) claims it first

A run's owner keeps only what is its own: scoring its beta, packing and finalize
(`scoring.run`), dedup its stages (`dedup.run`).

The engine (it reaches torch.distributed) loads on first use: the scores contract, which the CLI
imports at start, names `ReadBack` without starting torch (the demo fixes torch's CPU arithmetic
before torch starts).
"""

from importlib import import_module

_EXPORTS = {"GroupClaims": "pairclean.runs.claims", **dict.fromkeys(
    ("NODE_ENV", "Run", "RunIdentity", "Started", "by_node", "by_rank", "open_run"), "pairclean.runs.engine"),
    **dict.fromkeys(("CommitRecord", "PartStore", "ReadBack", "RunStart", "WrittenBy", "parts_dir_for",
                     "settings_changes", "settings_digest"),
    "pairclean.runs.store")}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
