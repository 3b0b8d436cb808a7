"""Where a dataset path points: this machine, or elsewhere (a URL with a scheme, a `pipe:` command).

Every stage asks: the reader (how to open it), the output guard (only local paths can overlap an
output), resume fingerprints and training's shard checks (only local files can be stat'ed).
"""

from __future__ import annotations


def is_local(url: str) -> bool:
    """A path on this machine, as opposed to a `pipe:` command or a URL with a scheme."""
    return "://" not in url and not url.startswith("pipe:")
