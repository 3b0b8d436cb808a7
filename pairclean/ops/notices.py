"""pairclean's one warning channel: the "pairclean" logger.

The library never prints: it logs a warning here, and the CLI shows each as a `warning: ...` line
on stderr while a command runs (see `pairclean.cli`). A Python caller sees them through its own
logging configuration, or Python's last-resort handler when it has none. A warning that names
settings lists their config fields (the record's `fields`), which the CLI words as flags, as it
does for `errors.ConfigError`.
"""

from __future__ import annotations

import logging

log = logging.getLogger("pairclean")

_said: set[str] = set()


def notice(message: str, *fields: str) -> None:
    """A warning about this call (e.g. the counts of one run); `fields`: the config fields it names."""
    log.warning(message, extra={"fields": fields})


def notice_once(key: str, message: str, *fields: str) -> None:
    """A warning printed once per process, however many batches hit the same condition."""
    if key not in _said:
        _said.add(key)
        notice(message, *fields)
