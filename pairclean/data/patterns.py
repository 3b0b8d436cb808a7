"""Shard patterns -> the ordered list of files a dataset reads: a directory (listed as the formats
list one: a Hugging Face hub folder keeps its files under data/), a glob, a brace pattern (counted
before it is expanded), a list file, an object-store URL with fsspec globs and prefix listings,
and `pipe:` commands only when allowed.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

from pairclean.data.formats import directory_files
from pairclean.data.reading.inputs import check_protocols
from pairclean.data.units import unique_shards
from pairclean.errors import ConfigError, UserError
from pairclean.ops.places import UNFINISHED
from pairclean.ops.urls import not_regular

MAX_PATTERN_NAMES = 1_000_000  # a brace pattern naming more shards than this is refused, not expanded


SHARD_SUFFIXES = (".tar", ".parquet", ".tar.gz", ".tgz")  # a URL ending so names one object


def _count_names(pattern: str) -> int:
    """How many names `braceexpand(pattern)` gives, counted with its grammar without making them
    (braceexpand builds every name of a range before yielding the first)."""
    import braceexpand

    total, pos, depth, start = 1, 0, 0, 0
    while pos < len(pattern):
        if pattern[pos] == "\\":
            pos += 2
            continue
        if pattern[pos] == "{":
            depth += 1
            start = pos if depth == 1 else start
        elif pattern[pos] == "}":
            depth -= 1
            if depth == 0:
                total *= _count_expression(pattern[start + 1:pos])
        pos += 1
    if depth:
        raise braceexpand.UnbalancedBracesError(pattern)
    return total


def _count_expression(expr: str) -> int:
    import braceexpand

    if match := braceexpand.int_range_re.match(expr):
        first, last, step = int(match[1]), int(match[2]), int(match[3] or 1) or 1
        return abs(last - first) // step + 1
    if match := braceexpand.char_range_re.match(expr):
        return len(braceexpand.make_char_range(*match.groups()))
    items, pos, depth, start = [], 0, 0, 0
    while pos < len(expr):
        if expr[pos] == "\\":
            pos += 2
            continue
        depth += {"{": 1, "}": -1}.get(expr[pos], 0)
        if expr[pos] == "," and depth == 0:
            items.append(expr[start:pos])
            start = pos + 1
        pos += 1
    if not items:  # not a sequence: the braces are literal, the inside is a pattern
        return _count_names(expr)
    return sum(_count_names(item) for item in items + [expr[start:]])


def _braces(pattern: str) -> list[str]:
    """webdataset's brace patterns (`shard-{000..009}.tar`); a pattern with unbalanced braces, or one
    naming more than MAX_PATTERN_NAMES shards, is a user error, named, not a crash or a hang."""
    import braceexpand

    try:
        names = _count_names(pattern)
    except braceexpand.UnbalancedBracesError:
        raise UserError(f"unbalanced braces in shard pattern {pattern!r} (a range reads like shard-{{000..009}}.tar)")
    if names > MAX_PATTERN_NAMES:
        raise UserError(f"shard pattern {pattern!r} names {names:,} shards, more than {MAX_PATTERN_NAMES:,}: "
                        "give a directory, a glob, or a list file")
    return list(braceexpand.braceexpand(pattern))


def _expand_one(pattern: str, base: Path, allow_pipe: bool) -> list[str]:
    """Expand a directory, glob, brace pattern or URL into a sorted list of shard paths."""
    if pattern.startswith("pipe:"):
        if not allow_pipe:
            raise ConfigError(f"refusing shell URL {pattern!r}: pass `allow_pipe` to run shell commands from shard lists",
                              "allow_pipe")
        return [pattern]
    if "://" in pattern:
        return [url for expanded in _braces(pattern) for url in _expand_url(expanded)]
    p = Path(pattern)
    if not p.is_absolute():
        p = base / p
    if p.is_dir():
        return directory_files(p)
    if p.is_file():  # a file whose name has braces or glob characters is itself
        return [str(p)]
    out: list[str] = []
    for expanded in _braces(str(p)):
        if any(ch in expanded for ch in "*?["):
            out.extend(sorted(glob.glob(expanded)))
        else:
            out.append(expanded)
    return out


def _expand_url(url: str) -> list[str]:
    """An object-store or other fsspec URL: a glob (`s3://b/x/*.tar`) or a prefix (ending in `/`,
    or naming no file: `s3://b/kept`) listed through fsspec, sorted; any other URL as given (a
    missing object becomes a failed unit). A prefix an output is still writing is refused."""
    globbed = any(ch in url for ch in "*?[")
    if not globbed and url.endswith(SHARD_SUFFIXES):
        return [url]
    import fsspec

    check_protocols([url])  # a missing filesystem package is the extra that brings it
    try:
        fs, path = fsspec.core.url_to_fs(url)
        fs.invalidate_cache()  # listings as they are now (this process may have written there since)
        if not (globbed or url.endswith("/") or fs.isdir(path)):
            return [url]
        found = fs.glob(path) if globbed else fs.ls(path, detail=False)
    except (ImportError, ValueError) as exc:
        raise UserError(f"cannot list {url}: {str(exc).splitlines()[0]}") from None
    except OSError as exc:
        raise UserError(f"cannot list {url}: {exc}") from None
    if any(p.rstrip("/").rsplit("/", 1)[-1] == UNFINISHED for p in found):
        raise UserError(f"{url} is still being written (or its writer was stopped): it holds {UNFINISHED}")
    return sorted(fs.unstrip_protocol(p) for p in found if p.endswith((".tar", ".parquet")))


def resolve_shards(patterns: list[str] | str, base: Path | None = None, allow_pipe: bool = False,
                   check_exist: bool = True) -> list[str]:
    """Turn user patterns (dir, glob, brace, list file, URL) into the ordered list of shards."""
    base = base or Path.cwd()
    if isinstance(patterns, str):
        patterns = [patterns]
    out: list[str] = []
    for pattern in patterns:
        p = Path(pattern) if "://" not in pattern and not pattern.startswith("pipe:") else None
        if p is not None and not p.is_absolute():
            p = base / p
        if p is not None and p.is_file() and p.suffix in (".txt", ".lst", ".list"):
            lines = [ln.strip() for ln in p.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
            for line in lines:
                out.extend(_expand_one(line, p.parent, allow_pipe))
        else:
            out.extend(_expand_one(pattern, base, allow_pipe))
    if check_exist:
        local = [s for s in out if "://" not in s and not s.startswith("pipe:")]
        missing = [s for s in local if not os.path.exists(s)]
        if missing:
            raise UserError(f"shard not found: {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        special = [(s, kind) for s in local if (kind := not_regular(s))]  # a named pipe blocks its first read
        if special:
            raise UserError(f"{special[0][0]} is not a regular file ({special[0][1]}): shards are read from regular "
                            "files only")
    if not out:
        raise UserError(f"no shards found in {', '.join(patterns)}")
    return unique_shards(out)


def absolute_source(source: str) -> str:
    """A source as given, made absolute (URLs and `pipe:` commands as they are): what is recorded."""
    return source if "://" in source or source.startswith("pipe:") or os.path.isabs(source) \
        else os.path.join(os.getcwd(), source)
