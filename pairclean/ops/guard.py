"""The output guard: every writing command checks its output here before it writes anything.

An output must never replace, delete or be read back as one of the run's inputs. Paths are
compared resolved (symlinks and `..` followed), so `x.tar`, `../shards/x.tar` and a link to it
are one file. Refused, in either direction:

- the output is an input (a scores file rewritten by the query or report that reads it);
- the output contains an input (`--out` equal to, or a parent of, the shards' directory: the
  replacement with `--overwrite` would delete them);
- the output lies inside an input directory (the next run over that directory reads it back):
  front ends pass the directories the user named along with the files read from them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from pairclean.ops.urls import is_local
from pairclean.errors import ConfigError


def _resolved(path: str | Path) -> Path:
    return Path(os.path.realpath(os.path.expanduser(str(path))))


def _within(path: Path, directory: Path) -> bool:
    return path == directory or directory in path.parents


def check_output(out: str | Path, inputs: Iterable[str | Path], field: str = "out") -> Path:
    """Refuse `out` when it overlaps any input file or directory; the resolved output path.
    `field`: the setting that holds `out`, named in the error."""
    target = _resolved(out)
    for given in inputs:
        if given is None or not is_local(str(given)):
            continue
        source = _resolved(given)
        if target == source:
            raise ConfigError(f"`{field}` {out} is an input of this run ({given}): write the output somewhere else", field)
        if _within(source, target):
            raise ConfigError(f"`{field}` {out} contains the input {given}: writing it would replace the input; "
                              "write the output somewhere else", field)
        if source.is_dir() and _within(target, source):
            raise ConfigError(f"`{field}` {out} is inside the input directory {given}: the next run over it would "
                              "read its own output; write the output somewhere else", field)
    return target


def check_file_prefix(prefix: str, field: str = "prefix") -> str:
    """A prefix of output file names stays a plain name: it cannot lead out of the output directory."""
    if not prefix or prefix in (".", "..") or "/" in prefix or os.sep in prefix or (os.altsep and os.altsep in prefix):
        raise ConfigError(f"`{field}` {prefix!r} must be a plain file-name prefix (no '/', not '.' or '..')", field)
    return prefix
