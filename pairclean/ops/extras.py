"""Optional dependencies: each is one of pyproject's extras, and a missing one is one line naming
the extra to install, never a ModuleNotFoundError crash.

`optional(module, extra)` imports a module that only an extra brings (`optional("sentence_transformers",
"text")`); `MissingExtra` is the UserError it raises (one line, exit 2 in the CLI);
`missing_extra(module, extra)` is that line, for a caller that reports it another way (a device
decoder says why it cannot run). Every extra of pyproject.toml that brings a module pairclean
imports is in `EXTRAS` (tests/test_first_use.py holds both to it, simulating each missing module).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from pairclean.errors import UserError

# extra -> what it is for, as the line says it
EXTRAS = {
    "text": "sentence-transformers models (text-text pairs)",
    "s3": "s3:// shards",
    "gcs": "gs:// shards",
    "gpu": "NVIDIA's device JPEG decoders (nvimgcodec, dali)",
    "ray": "distributed scoring on a Ray cluster",
}
# fsspec protocol -> (the module of its filesystem, the extra that brings it)
PROTOCOL_EXTRAS = {"s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}


class MissingExtra(UserError):
    """An optional dependency is not installed: the line names the extra that brings it."""


def install_line(extra: str) -> str:
    """How to install `extra`, from PyPI or in a clone."""
    return f"pip install 'pairclean[{extra}]' (in a clone: pip install -e '.[{extra}]')"


def missing_extra(module: str, extra: str) -> str:
    """The line for a missing `module` that `extra` brings."""
    return f"{EXTRAS[extra]} need the {extra} extra, which is not installed (no module {module}): {install_line(extra)}"


def optional(module: str, extra: str) -> ModuleType:
    """`module`, imported; MissingExtra naming `extra` when it (or a module it needs) is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = getattr(exc, "name", None) or module
        raise MissingExtra(missing_extra(missing, extra)) from None
