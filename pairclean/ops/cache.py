"""Where pairclean keeps what it computes once and reuses (the random-inputs beta, the demo's toy estimator)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$PAIRCLEAN_CACHE_DIR, else $XDG_CACHE_HOME/pairclean, else ~/.cache/pairclean."""
    if os.environ.get("PAIRCLEAN_CACHE_DIR"):
        return Path(os.environ["PAIRCLEAN_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pairclean"
