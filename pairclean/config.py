"""What every config dataclass shares: which fields pin a resumed run, declared once per field.

A resumed run (scoring or training) must have been started with the same settings, except for
the fields that cannot change its result (where it runs, how fast, whether to show progress).
Those are declared at the field with `unpinned(...)`; `pinned_settings(cfg)` is the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Any

_PINNED = "pinned"


def unpinned(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING):
    """A config field that a resumed run may change without changing its result."""
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata={_PINNED: False})
    return dataclasses.field(default=default, metadata={_PINNED: False})


def pinned_settings(cfg) -> dict:
    """The fields of a config dataclass that a resumed run must share with the run it continues."""
    return {f.name: _plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.metadata.get(_PINNED, True)}


def _plain(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value
