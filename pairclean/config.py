"""What every config dataclass shares: which fields pin a resumed run, declared once per field.

A resumed run (scoring or training) must have been started with the same settings, except for
the fields that cannot change its result (where it runs, how fast, whether to show progress).
Those are declared at the field with `unpinned(...)`; `pinned_settings(cfg)` is the rest.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pairclean.errors import ConfigError

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


def check_numbers(cfg, finite: tuple[str, ...] = (), at_least: dict[str, int | float] | None = None) -> None:
    """Refuse numeric settings that would poison a run at the edge, with one line naming the field:
    NaN or infinite values (a NaN beta sorts above every score), counts below their minimum."""
    for name in finite:
        value = getattr(cfg, name)
        if value is not None and (isinstance(value, bool) or not math.isfinite(value)):
            raise ConfigError(f"{name} must be a finite number, got {value}", name)
    for name, low in (at_least or {}).items():
        value = getattr(cfg, name)
        if not math.isfinite(value) or value < low:
            raise ConfigError(f"{name} must be at least {low}, got {value}", name)


def check_choice(value: Any, choices, field: str, what: str | None = None) -> None:
    """Refuse a value outside a fixed set, naming the config field and every choice (one wording for all)."""
    if value not in choices:
        raise ConfigError(f"unknown {what or field} {value!r} for `{field}`; "
                          f"choose one of {', '.join(map(str, choices))}", field)


def check_pretrained(pretrained: str | None) -> None:
    """An empty weights name is a mistake (an unset variable), not a request for random init."""
    if pretrained is not None and not str(pretrained).strip():
        raise ConfigError("pretrained is empty: give a pretrained tag, a checkpoint path, or 'none' for random init",
                          "pretrained")
