"""The output guard: the one way a command opens an output.

`open_output(out, inputs, field)` is called before anything is written; it refuses an output that
would replace, delete or be read back as one of the run's inputs, and returns an `Output`, the
only handle through which the output is then written (atomically: a temp name renamed into place,
`Output.write` for a file, `Output.stage` for a directory written whole). A command that owns a
run directory (scoring's parts, a training run, the demo) writes inside `Output.path` itself.

Every spelling is compared as the file it names (`ops.urls.local_path`: `file://D/x.parquet` is
`D/x.parquet`), resolved (symlinks and `..` followed), so `x.tar`, `../shards/x.tar`, a link to it
and its `file://` URL are one file. Refused, in either direction:

- the output is an input (a scores file rewritten by the query or report that reads it);
- the output contains an input (`--out` equal to, or a parent of, the shards' directory: the
  replacement with `--overwrite` would delete them);
- the output lies inside an input directory (the next run over that directory reads it back):
  front ends pass the directories the user named along with the files read from them.

The same holds for an output's companions (files or directories written beside it: a scoring
run's `<out>.parts/` and `<stem>.run.json`). An output on an object store (`s3://`, `gs://`, any
fsspec URL: `ops.places.RemotePath`) is compared with the inputs in the same store by URL, and the
store is checked before anything is written (credentials, the bucket). `tests/test_outputs.py` walks every command's output
options and proves each is refused this way.
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from pairclean.errors import ConfigError, UserError
from pairclean.ops.atomic import atomic_directory, atomic_path, write_json
from pairclean.ops.places import RemotePath, is_remote, reachable
from pairclean.ops.urls import local_path

KINDS = ("file", "directory")


@dataclass(frozen=True)
class Output:
    """An output that passed the guard. `overwrite`: replace an existing output (True), refuse a
    non-empty one (False), or leave that to the command that owns it (None: run directories that
    resume)."""

    path: Path | RemotePath
    field: str
    kind: str
    overwrite: bool | None
    inputs: tuple[str, ...] = ()
    companions: tuple[Path, ...] = ()

    @contextmanager
    def write(self, temp_dir: str | os.PathLike | None = None, no_clobber: bool = False) -> Iterator[Path]:
        """A temp path to write the file to; renamed over `path` when the block ends without error."""
        if self.kind != "file":
            raise TypeError(f"{self.path} is a directory output: stage() it")
        with atomic_path(self.path, temp_dir=temp_dir, no_clobber=no_clobber) as tmp:
            yield tmp

    def write_json(self, obj) -> None:
        with self.write() as tmp:
            write_json(tmp, obj)

    @contextmanager
    def stage(self) -> Iterator[Path]:
        """A temp directory to fill; renamed to `path` when the block ends without error."""
        if self.kind != "directory":
            raise TypeError(f"{self.path} is a file output: write() it")
        with atomic_directory(self.path, overwrite=bool(self.overwrite)) as tmp:
            yield tmp


def _resolved(path: str | Path | RemotePath) -> Path | RemotePath:
    if isinstance(path, RemotePath):
        return path
    return Path(os.path.realpath(os.path.expanduser(str(path))))


def _within(path: Path | RemotePath, directory: Path | RemotePath) -> bool:
    if isinstance(path, RemotePath) or isinstance(directory, RemotePath):
        return isinstance(path, RemotePath) and isinstance(directory, RemotePath) and path.within(directory)
    return path == directory or directory in path.parents


def _overlap(target: Path | RemotePath, source: Path | RemotePath) -> int:
    """How `target` (written) overlaps `source` (read): 3 it is the input, 2 it contains it, 1 it lies
    inside the input directory, 0 not at all."""
    if target == source:
        return 3
    if _within(source, target):
        return 2
    return 1 if _within(target, source) and source.is_dir() else 0


def _apart(output: Output, other: Output) -> None:
    """Two outputs of one run (each with its companions) never equal or contain one another: the
    one written last would replace the other, or be removed with it, whether or not either exists yet."""
    for written in (output.path, *output.companions):
        for theirs in (other.path, *other.companions):
            mine, their = _resolved(written), _resolved(theirs)
            if _within(mine, their) or _within(their, mine):
                how = "is" if mine == their else ("is inside" if _within(mine, their) else "contains")
                raise ConfigError(f"`{output.field}` {_named(output, written)} {how} `{other.field}` "
                                  f"{_named(other, theirs)}, another output of this run: give them places apart",
                                  output.field, other.field)


def _named(output: Output, written: Path) -> str:
    """An output's path, or a companion's as `out (its name)`."""
    return str(output.path) if written == output.path else f"{output.path} (its {Path(written).name})"


def _guard(output: Output, inputs: Iterable) -> tuple[str, ...]:
    """The local inputs, after refusing the worst overlap of the output (or a companion) with any of
    them; an `Output` among them is another output of the same run (`_apart`)."""
    checked, worst = [], (0, None, None)
    for given in inputs:
        if isinstance(given, Output):
            _apart(output, given)
            continue
        path = local_path(str(given)) if given is not None else None
        if path is None and isinstance(output.path, RemotePath) and is_remote(given):
            path = given if isinstance(given, RemotePath) else RemotePath(str(given), output.path.fs)
        if path is None:  # none, a command, or a URL in another place than the output: nothing here can overwrite it
            continue
        source = _resolved(path)
        for written in (output.path, *output.companions):
            worst = max(worst, (_overlap(_resolved(written), source), str(written), str(given)), key=lambda w: w[0])
        checked.append(str(given))
    kind, written, given = worst
    if kind:
        shown = str(output.path) if written == str(output.path) else f"{output.path} (its {Path(written).name})"
        field = output.field
        raise ConfigError({
            3: f"`{field}` {shown} is an input of this run ({given}): write the output somewhere else",
            2: f"`{field}` {shown} contains the input {given}: writing it would replace the input; "
               "write the output somewhere else",
            1: f"`{field}` {shown} is inside the input directory {given}: the next run over it would "
               "read its own output; write the output somewhere else"}[kind], field)
    return tuple(checked)


def open_output(out: str | os.PathLike | Output, inputs: Iterable = (), field: str = "out", *, kind: str = "file",
                overwrite: bool | None = False, companions: Iterable[str | os.PathLike] = (),
                parents: bool = False) -> Output:
    """Check the output `out` against every input (files read and directories named; None and
    remote URLs are skipped; an `Output` is another output of the same run, which this one may not
    equal, contain or lie inside, nor the reverse) and return the handle to write it through.
    `field`: the setting that holds `out`, named in errors. `kind`: a file or a directory. `overwrite`: see `Output` (an
    existing output is replaced only when the caller's config says so). `parents`: a missing parent
    directory is no error (the owner of a run directory creates it with its parents). An `Output` opened earlier
    (by a front end that knows the directories the user named) is checked against these inputs
    too, and its companions with them."""
    if isinstance(out, Output):
        more = dataclasses.replace(out, companions=out.companions + tuple(
            c if isinstance(c, RemotePath) else Path(c) for c in companions))
        return dataclasses.replace(more, inputs=_guard(more, [*out.inputs, *inputs]))
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if is_remote(out):
        return _open_remote(out if isinstance(out, RemotePath) else RemotePath(str(out)), inputs, field, kind,
                            overwrite, companions)
    path = local_path(str(out))
    if path is None:
        raise ConfigError(f"`{field}` {out} is a command, not a place to write: give a path or an object-store URL",
                          field)
    if not path.strip():
        raise ConfigError(f"`{field}` is empty: give the path to write", field)
    path = Path(os.path.expanduser(path))
    output = Output(path, field, kind, overwrite, companions=tuple(Path(c) for c in companions))
    output = dataclasses.replace(output, inputs=_guard(output, inputs))
    if kind == "file" and path.is_dir():
        raise ConfigError(f"`{field}` {path} is a directory: give the file to write", field)
    if kind == "directory" and path.exists() and not path.is_dir():
        raise ConfigError(f"`{field}` {path} is a file: give a directory to write", field)
    if overwrite is False and path.is_file():
        raise ConfigError(f"{path} exists; pass `overwrite` to replace it", "overwrite")
    if overwrite is False and path.is_dir() and any(path.iterdir()):
        raise ConfigError(f"{path} exists and is not empty; pass `overwrite` to replace it", "overwrite")
    if not parents and not path.parent.exists():
        raise UserError(f"directory {path.parent} does not exist (to write {path} in)")
    if parents and not (ancestor := next(p for p in path.parents if p.exists())).is_dir():
        raise UserError(f"{ancestor} is a file: {path} cannot be created in it")
    return output


def _open_remote(path: RemotePath, inputs: Iterable, field: str, kind: str, overwrite: bool | None,
                 companions: Iterable) -> Output:
    """`open_output` for an object store: the store checked first (credentials, the bucket), then
    the same guard as on disk, compared by URL."""
    reachable(path, field)
    output = Output(path, field, kind, overwrite,
                    companions=tuple(c if isinstance(c, RemotePath) else RemotePath(str(c), path.fs) for c in companions))
    output = dataclasses.replace(output, inputs=_guard(output, inputs))
    if overwrite is False and path.exists():
        raise ConfigError(f"{path} exists; pass `overwrite` to replace it", "overwrite")
    return output


def check_file_prefix(prefix: str, field: str = "prefix") -> str:
    """A prefix of output file names stays a plain name: it cannot lead out of the output directory."""
    if not prefix or prefix in (".", "..") or "/" in prefix or os.sep in prefix or (os.altsep and os.altsep in prefix):
        raise ConfigError(f"`{field}` {prefix!r} must be a plain file-name prefix (no '/', not '.' or '..')", field)
    return prefix
