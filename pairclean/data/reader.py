"""The one reader: the only code that turns a shard into rows, so every command numbers rows alike.

A row is `(shard, index, key)`: its position in the shard after the members are grouped into
samples. `read_unit`, `list_units` and `count_pairs` are the entry points: each goes through the
dataset's input format (`data.formats`), which reads with the mechanics below. Three modes read a
tar shard with one member-skip rule and one grouping rule: `read_tar_pairs` gives RawPairs
(scoring, training, report, corrupt's pass 1), `read_samples` the members exactly as stored
(filter and corrupt copy them), `list_samples` the member sizes from the headers alone (train's
key checks, filter's dry run); `read_parquet_pairs` reads a Parquet row group. A *unit* (see
`units`) is one tar shard or one Parquet row group; when it breaks (truncated tar, vanished file,
unreadable Parquet) the rows before the break are kept and a UnitFailure goes to the caller's
error policy, like webdataset's `handler=`: `read_unit` yields it as its last item, a list's
`append` records it, `raise_failure` stops the command.

Local files and `pipe:` commands are opened with webdataset's `gopen`; every other URL
(`s3://`, `gs://`, `az://`, `https://`, ...) with fsspec (`open_input`), so object stores are
read natively with their usual credentials, no shell involved. Member names are split by webdataset's `base_plus_ext`, but members are read and grouped here
rather than by `tarfile_samples`, because that silently loses data on three hostile inputs:
tarfile ends without an error on a truncated or corrupt member *header*, a repeated key
(`a.jpg a.txt a.jpg a.txt`) makes `group_by_keys` drop the second pair, and a member of any size
is read into memory.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pyarrow.parquet as pq
import webdataset as wds
from webdataset.tariterators import base_plus_ext, meta_prefix, meta_suffix

from pairclean.errors import ConfigError, UserError
from pairclean.data.manifest import PAIR_KINDS, DatasetSpec, unique_shards
from pairclean.data.units import Unit
from pairclean.ops.urls import file_kind, is_local, not_regular

# Text encoders keep the first 77 (CLIP) or 256 (MiniLM) tokens, far fewer than 4096 characters;
# a longer caption only costs tokeniser time (CLIP's BPE is quadratic in the length of a word).
MAX_TEXT_CHARS = 4096
MAX_SHOWN = 120  # characters of a stored value an error message quotes (never an image's bytes)
MAX_MEMBER_BYTES = 256 << 20  # a tar member bigger than this is refused without being read (pairs mode)
_SKIP_META = re.compile(r"__[^/]*__($|/)")  # webdataset's tar_file_iterator skip_meta


@dataclass
class RawPair:
    key: str
    shard: str
    index: int
    left: bytes | str | None = None
    right: bytes | str | None = None
    error: str | None = None


@dataclass
class UnitFailure:
    unit: str
    reason: str
    fields: tuple[str, ...] = ()  # the config fields the reason names (a front end words them its way)


OnFailure = Callable[[UnitFailure], None]  # the error policy: return to keep the rows read so far, or raise


def raise_failure(failure: UnitFailure) -> None:
    """The error policy of commands that copy shards whole: a shard that breaks stops the command."""
    message = f"cannot read {failure.unit}: {failure.reason}"
    raise ConfigError(message, *failure.fields) if failure.fields else UserError(message)


@dataclass
class Sample:
    """A tar sample as stored: member suffix (case kept) -> bytes (`read_samples`) or size (`list_samples`)."""

    key: str
    shard: str
    index: int
    members: dict[str, bytes | int]


def open_input(url: str):
    """A readable binary stream of a shard or file: webdataset's `gopen` for local paths and
    `pipe:` commands, fsspec for any other URL (credentials and endpoints from the
    filesystem's usual environment, e.g. AWS_* variables for s3fs)."""
    if is_local(url) or url.startswith("pipe:"):
        return wds.gopen(url)
    import fsspec

    return fsspec.open(url, "rb").open()


def check_protocols(urls: list[str]) -> None:
    """Every URL scheme is one fsspec can read here, else a UserError before anything is written
    (a missing s3fs would otherwise fail every shard of the run one by one)."""
    import fsspec

    for protocol in sorted({url.split("://", 1)[0] for url in urls if not is_local(url) and "://" in url}):
        try:
            fsspec.get_filesystem_class(protocol)
        except (ImportError, ValueError) as exc:
            raise UserError(f"cannot read {protocol}:// shards: {str(exc).splitlines()[0]} "
                            "(pip install 'pairclean[s3]' or 'pairclean[gcs]' for s3:// and gs://)") from None


def parquet_file(path: str) -> pq.ParquetFile:
    if is_local(path) and (kind := not_regular(path)):
        raise UserError(f"{path} is not a regular file ({kind})")
    return pq.ParquetFile(path if is_local(path) else open_input(path))


def modalities(pair: str) -> tuple[str, str]:
    """(left, right) modality of a pair kind."""
    return {"image-text": ("image", "text"), "text-text": ("text", "text"),
            "image-label": ("image", "text"), "image-image": ("image", "image")}[pair]


def list_units(spec: DatasetSpec) -> list[str]:
    """Every unit of the dataset, in a stable order (the order of the output rows), as its format
    cuts it.

    A shard listed twice (overlapping patterns, a repeated line in a list file) is one unit:
    its pairs would otherwise be scored, and written, twice.
    """
    shards = unique_shards(spec.shards)
    if not spec.allow_pipe and any(s.startswith("pipe:") for s in shards):
        raise ConfigError("refusing shell `pipe:` shard URLs: pass `allow_pipe` to run shell commands from shard lists",
                          "allow_pipe")
    check_protocols(shards)
    return spec.input_format.units()


def parquet_row_groups(shards: list[str]) -> list[str]:
    """Each Parquet file's row groups as units (a file that cannot be opened is one unit, whose
    read reports why)."""
    units = []
    for path in unique_shards(shards):
        try:
            n = parquet_file(path).metadata.num_row_groups  # 0 for an empty file: no unit, no pairs
        except Exception:
            n = 1
        units.extend(str(Unit.row_group(path, i)) for i in range(n))
    return units


def shown(value) -> str:
    """A stored value as an error message may quote it: its type and length for bytes and
    structures, else its text cut to MAX_SHOWN characters."""
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value):,} bytes>"
    if isinstance(value, dict):
        return f"<struct: {', '.join(map(str, value))}>"
    if isinstance(value, (list, tuple)):
        return f"<list of {len(value)}>"
    text = str(value)
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "..."


class _Oversized:
    """Stands in for a tar member that was too big to read."""

    def __init__(self, name: str, size: int, what: str = "member"):
        self.reason = f"{what} {name} is {size:,} bytes, over the {MAX_MEMBER_BYTES:,}-byte limit"


def _decode_text(raw: bytes | str | None, what: str) -> tuple[str | None, str | None]:
    if raw is None:
        return None, f"missing {what}"
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            return None, f"{what} is not valid UTF-8"
    if not isinstance(raw, str):  # a Parquet column of numbers, lists or structs
        return None, f"{what} is {type(raw).__name__}, not text"
    text = raw.strip()
    if not text:
        return None, f"empty {what}"
    return text[:MAX_TEXT_CHARS], None


def _wds_text(sample: dict, ext: str, json_key: str | None) -> tuple[str | None, str | None]:
    if ext in sample:
        if isinstance(sample[ext], _Oversized):
            return None, sample[ext].reason
        return _decode_text(sample[ext], "caption")
    if json_key and "json" in sample:
        if isinstance(sample["json"], _Oversized):
            return None, sample["json"].reason
        try:
            value = json.loads(sample["json"]).get(json_key)
        except Exception:
            return None, "json member is not valid JSON"
        return _decode_text(value if value is None or isinstance(value, str) else str(value), "caption")
    return None, "missing caption"


def _wds_image(sample: dict, candidates: list[str]) -> tuple[bytes | None, str | None]:
    for ext in candidates:
        if ext in sample:
            if isinstance(sample[ext], _Oversized):
                return None, sample[ext].reason
            return sample[ext], None
    return None, f"no image member (looked for {', '.join(candidates)})"


def _fill(pair: RawPair, side: str, value, error) -> None:
    setattr(pair, side, value)
    if error and pair.error is None:
        pair.error = error


def json_value(sample: dict, name: str):
    """A value of the sample's json member (None when there is no member, no such key, or no JSON)."""
    raw = sample.get("json")
    if raw is None or isinstance(raw, (_Oversized, int)):
        return None
    try:
        obj = json.loads(raw)
    except Exception:
        return None
    return obj.get(name) if isinstance(obj, dict) else None


def sample_key(key_field: str | None, raw: Sample) -> str:
    """A tar sample's key: its member names' prefix (`__key__`), or a key of its json member
    (DataComp's `uid`), falling back to the prefix when the member lacks it."""
    if key_field in (None, "__key__"):
        return raw.key
    value = json_value({s.lower(): v for s, v in raw.members.items()}, key_field)
    return raw.key if value is None else str(value)


def _wds_pair(spec: DatasetSpec, raw: Sample) -> RawPair:
    f = spec.fields
    pair = RawPair(key=sample_key(f.key, raw), shard=raw.shard, index=raw.index)
    sample = {suffix.lower(): value for suffix, value in raw.members.items()}
    if spec.pair in ("image-text", "image-label", "image-image"):
        _fill(pair, "left", *_wds_image(sample, f.image_candidates()))
    if spec.pair == "image-text":
        _fill(pair, "right", *_wds_text(sample, f.text, f.json_text_key))
    elif spec.pair == "image-label":
        label, err = _wds_text(sample, f.label, None)
        _fill(pair, "right", spec.label_template.format(label=label) if label else None, err and err.replace("caption", "label"))
    elif spec.pair == "image-image":
        _fill(pair, "right", *_wds_image(sample, f.image_candidates(second=True)))
    elif spec.pair == "text-text":
        _fill(pair, "left", *_wds_text(sample, f.text, f.json_text_key))
        second, err = _wds_text(sample, f.text2, None)
        _fill(pair, "right", second, err and err.replace("caption", "second text"))
    return pair


class _HeaderWatch(tarfile.TarInfo):
    """tarfile ends its member loop *silently* on an empty, truncated or corrupt header; a
    subclass made per archive remembers which header error ended the loop.

    It wraps `fromtarfile`, the public classmethod `TarFile.next()` calls for every header, not
    `frombuf`: newer tarfiles (seen: Ubuntu's Python 3.12.3 build) route `fromtarfile` through
    private `_fromtarfile`/`_frombuf`, so a `frombuf` hook never saw the end-of-archive marker
    and every whole shard looked truncated."""

    stop: Exception | None = None

    @classmethod
    def fromtarfile(cls, tarfile_):
        try:
            return super().fromtarfile(tarfile_)
        except tarfile.HeaderError as exc:
            cls.stop = exc
            raise


def _end_of_archive_problem(stop: Exception | None, members: int) -> str | None:
    """Why the member loop ended, if it was not the end-of-archive marker."""
    if isinstance(stop, tarfile.EOFHeaderError):
        return None
    where = f"after {members} member(s)"
    if isinstance(stop, tarfile.EmptyHeaderError):
        return f"truncated tar: the file ends {where} without an end-of-archive marker"
    if isinstance(stop, tarfile.TruncatedHeaderError):
        return f"truncated tar: the file ends inside a member header {where}"
    if isinstance(stop, tarfile.InvalidHeaderError):
        return f"corrupt tar: unreadable member header {where} ({stop}); the rest of the shard was not read"
    return f"tar ended unexpectedly {where}"


def _error_line(exc: BaseException) -> str:
    text = str(exc.args[0]) if exc.args else str(exc)
    return f"{type(exc).__name__}: {text}".splitlines()[0][:300]


def _refusal(url: str, allow_pipe: bool) -> UnitFailure | None:
    if url.startswith("pipe:") and not allow_pipe:
        return UnitFailure(url, "refusing a shell `pipe:` URL without `allow_pipe`", ("allow_pipe",))
    if is_local(url) and not os.path.exists(url):
        return UnitFailure(url, "shard not found (it disappeared after the run started?)")
    if is_local(url) and (kind := not_regular(url)):
        return UnitFailure(url, f"not a regular file ({kind}): it is not read")
    return None


def _skipped(info: tarfile.TarInfo) -> bool:
    """The member-skip rule: what webdataset's tar_file_iterator never hands on (all but regular
    files, and `__meta__`-style members)."""
    name = info.name
    return not info.isreg() or bool(_SKIP_META.match(name)) or (
        "/" not in name and name.startswith(meta_prefix) and name.endswith(meta_suffix))


def _present_size(archive: tarfile.TarFile, info: tarfile.TarInfo) -> int:
    """Header mode: the member's size once its last byte is known to be in the file, so that a
    member whose data is cut off ends the listing where reading it ends the other modes."""
    if info.size:
        archive.fileobj.seek(info.offset_data + info.size - 1)
        if not archive.fileobj.read(1):
            raise tarfile.ReadError("unexpected end of data")
    return info.size


def _capped_bytes(archive: tarfile.TarFile, info: tarfile.TarInfo) -> bytes | _Oversized:
    """Pairs mode: the member's bytes, or a stand-in when it is too big to hold in memory."""
    if info.size > MAX_MEMBER_BYTES:
        _present_size(archive, info)
        return _Oversized(info.name, info.size)
    return archive.extractfile(info).read()


def _whole_bytes(archive: tarfile.TarFile, info: tarfile.TarInfo) -> bytes:
    """Raw mode: the member's bytes whatever their size, since a copy must be complete."""
    return archive.extractfile(info).read()


ReadMember = Callable[[tarfile.TarFile, tarfile.TarInfo], object]


def _tar_members(url: str, problems: list[UnitFailure], member: ReadMember, allow_pipe: bool,
                 seek: bool = False) -> Iterator[tuple[str, object]]:
    """(name, member(archive, info)) of the shard's members in archive order, less the skipped
    ones. Whatever ends the shard early (a vanished file, an unreadable stream, a truncated or
    corrupt tar, a failing `pipe:`/curl) is appended to `problems`. `seek` opens a local shard
    for random access, so data that is not read is seeked over."""
    problem = _refusal(url, allow_pipe)
    if problem:
        problems.append(problem)
        return
    watch = type("_Watch", (_HeaderWatch,), {})
    members = 0
    stream = None
    try:
        stream = open_input(url)
        mode = "r:*" if seek and is_local(url) else "r|*"
        with tarfile.open(fileobj=stream, mode=mode, tarinfo=watch) as archive:
            for info in archive:
                archive.members = []  # tarfile keeps every TarInfo otherwise
                if _skipped(info):
                    continue
                members += 1
                yield info.name, member(archive, info)
        problem = _end_of_archive_problem(watch.stop, members)
    except (tarfile.ReadError, EOFError) as exc:  # EOFError: a cut .tar.gz opened for random access
        cut = isinstance(exc, EOFError) or "unexpected end" in str(exc)
        problem = (f"truncated tar: the file ends inside member data after {members} member(s)" if cut
                   else f"unreadable tar: {_error_line(exc)}")
    except Exception as exc:  # any way a shard can break: the rows read so far are kept
        problem = _error_line(exc)
    finally:
        if stream is not None:
            try:
                stream.close()  # a pipe's exit status is checked here
            except Exception as exc:
                problem = problem or _error_line(exc)
    if problem:
        problems.append(UnitFailure(url, problem))


def _grouped(members: Iterator[tuple[str, object]]) -> Iterator[tuple[str, dict[str, object]]]:
    """The grouping rule: consecutive members with one key make a sample, as in webdataset's
    `group_by_keys`, except that a suffix already in the sample (compared case-blind) starts a new
    one: keys may repeat, even back to back, and each occurrence is its own row."""
    key, sample = None, {}
    for name, value in members:
        prefix, suffix = base_plus_ext(name)
        if prefix is None:
            continue
        if sample and (prefix != key or suffix.lower() in {s.lower() for s in sample}):
            yield key, sample
            sample = {}
        key = prefix
        sample[suffix] = value
    if sample:
        yield key, sample


def _tar_samples(url: str, on_failure: OnFailure, member: ReadMember, allow_pipe: bool,
                 seek: bool = False) -> Iterator[Sample]:
    """The grouped samples, then the failure, if any, to the error policy: once, after every row
    before the break (the last sample is only complete when the member loop has ended)."""
    problems: list[UnitFailure] = []
    for index, (key, members) in enumerate(_grouped(_tar_members(url, problems, member, allow_pipe, seek))):
        yield Sample(key, url, index, members)
    if problems:
        on_failure(problems[0])


def read_samples(url: str, on_failure: OnFailure, allow_pipe: bool = False) -> Iterator[Sample]:
    """Raw mode: the tar shard's samples with every member's bytes exactly as stored."""
    return _tar_samples(url, on_failure, _whole_bytes, allow_pipe)


def list_samples(url: str, on_failure: OnFailure, allow_pipe: bool = False,
                 read: tuple[str, ...] = ()) -> Iterator[Sample]:
    """Header mode: the tar shard's samples with each member's size in bytes; a local shard's
    member data is seeked over, not read, except members with a suffix in `read` (e.g. `json`,
    to take a key from it), whose bytes are given (capped like pairs mode)."""
    if not read:
        return _tar_samples(url, on_failure, _present_size, allow_pipe, seek=True)
    wanted = {suffix.lower() for suffix in read}

    def member(archive: tarfile.TarFile, info: tarfile.TarInfo):
        suffix = base_plus_ext(info.name)[1]
        return _capped_bytes(archive, info) if suffix and suffix.lower() in wanted else _present_size(archive, info)

    return _tar_samples(url, on_failure, member, allow_pipe, seek=True)


def count_pairs(spec: DatasetSpec, unit: str) -> int:
    """Header mode for a unit: how many rows it holds (a Parquet row group's count from the file's
    metadata, a tar shard's from its member headers), rows before a break included."""
    return spec.input_format.count(unit)


def read_tar_pairs(spec: DatasetSpec, unit: str) -> Iterator[RawPair | UnitFailure]:
    """Pairs mode for a tar shard."""
    failures: list[UnitFailure] = []
    for sample in _tar_samples(unit, failures.append, _capped_bytes, spec.allow_pipe):
        yield _wds_pair(spec, sample)
    yield from failures


def safe_join(root: Path, relative: str) -> Path | None:
    """Resolve a path from a Parquet column under the dataset root; None if it escapes the root."""
    root = root.resolve()
    candidate = (root / relative).resolve()
    return candidate if candidate == root or root in candidate.parents else None


def _read_image_path(root: Path, value) -> tuple[bytes | None, str | None]:
    if value is None or value == "":
        return None, "missing image path"
    if not isinstance(value, str):
        return None, f"image path is {shown(value)}, not text"
    path = safe_join(root, value)
    if path is None:
        return None, f"image path escapes the dataset root: {shown(value)}"
    try:
        # Non-blocking open, then fstat before anything is read: a folder, FIFO or device is
        # refused instead of failing or hanging the reader, and a file is held to the same size
        # limit as a tar member.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        return None, f"cannot read image file {shown(value)}: {exc.strerror or exc}"
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        return None, f"image path {shown(value)} is not a regular file ({file_kind(info.st_mode)})"
    with os.fdopen(fd, "rb") as fh:
        if info.st_size > MAX_MEMBER_BYTES:
            return None, _Oversized(str(value), info.st_size, "image file").reason
        try:
            data = fh.read(MAX_MEMBER_BYTES + 1)
        except OSError as exc:
            return None, f"cannot read image file {shown(value)}: {exc.strerror or exc}"
    if len(data) > MAX_MEMBER_BYTES:  # it grew after the check
        return None, _Oversized(str(value), len(data), "image file").reason
    return data, None


def _parquet_columns(spec: DatasetSpec) -> dict[str, str | None]:
    f = spec.fields
    cols = {"key": f.key}
    if spec.pair in ("image-text", "image-label", "image-image"):
        cols["left_image"] = f.image_path or f.image
    if spec.pair == "image-text":
        cols["right_text"] = f.text
    elif spec.pair == "image-label":
        cols["right_label"] = f.label
    elif spec.pair == "image-image":
        cols["right_image"] = f.image2_path or f.image2
    elif spec.pair == "text-text":
        cols["left_text"] = f.text
        cols["right_text"] = f.text2
    return cols


def positional_key(path: str, index: int) -> str:
    """The key of a Parquet row when the file has no key column."""
    return f"{Path(path).stem}/{index}"


def parquet_keys(spec: DatasetSpec, path: str) -> list[str]:
    """Header mode for Parquet: the keys of every row of the file, reading the key column alone."""
    pf = parquet_file(path)
    if spec.fields.key in pf.schema_arrow.names:
        return [str(k) for k in pf.read(columns=[spec.fields.key]).column(0).to_pylist()]
    return [positional_key(path, i) for i in range(pf.metadata.num_rows)]


def _image_value(value, root: Path) -> tuple[bytes | None, str | None]:
    """An image column's value: bytes, or a Hugging Face `Image` struct {bytes, path} (bytes when
    embedded, else the file at path under the dataset root)."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value), None
    if value is None:
        return None, "missing image"
    if isinstance(value, dict) and {"bytes", "path"} <= set(value):
        if value["bytes"] is not None:
            return value["bytes"], None
        return _read_image_path(root, value["path"])
    kind = shown(value) if isinstance(value, dict) else type(value).__name__
    return None, f"image column holds {kind}, not image bytes"


def _pairs_fitting(spec: DatasetSpec, available: set[str]) -> list[str]:
    """Other pair kinds whose default columns a Parquet file has: the likely fix when the given
    kind's columns are missing (text-text pairs read as the default image-text)."""
    fits = []
    for kind in PAIR_KINDS:
        other = DatasetSpec(format=spec.format, shards=spec.shards, pair=kind)
        if kind != spec.pair and all(c in available or c == other.fields.key for c in _parquet_columns(other).values()):
            fits.append(kind)
    return fits


RowError = Callable[[dict], "str | None"]  # a format's own per-row failure (img2dataset's status), from `extra` columns


def read_parquet_pairs(spec: DatasetSpec, unit: str, root: Path, extra: tuple[str, ...] = (),
                       row_error: RowError | None = None) -> Iterator[RawPair | UnitFailure]:
    """Pairs mode for a Parquet row group. Image paths are read under `root`; `row_error(values of
    the `extra` columns)` names a row the source itself marks failed (it becomes an error row)."""
    parsed = Unit.parse(unit)
    path, rg = parsed.path, parsed.part
    try:
        pf = parquet_file(path)
        offset = sum(pf.metadata.row_group(i).num_rows for i in range(rg))
        cols = _parquet_columns(spec)
        available = set(pf.schema_arrow.names)
        missing = [c for c in cols.values() if c not in available and c != spec.fields.key]
        if missing:
            fits = _pairs_fitting(spec, available)
            hint = f"; its columns fit `pair` {' or '.join(fits)}" if fits else ""
            yield UnitFailure(unit, f"column(s) {missing} not in {path} (has {sorted(available)}){hint}",
                              ("pair",) if fits else ())
            return
        extra = tuple(c for c in extra if c in available)
        table = pf.read_row_group(rg, columns=[c for c in dict.fromkeys([*cols.values(), *extra]) if c in available])
    except Exception as exc:
        yield UnitFailure(unit, f"cannot read Parquet: {str(exc).splitlines()[0][:300]}")
        return
    f = spec.fields
    extras = {c: table.column(c).to_pylist() for c in extra}
    by_path = {"left_image": f.image_path is not None, "right_image": f.image2_path is not None}
    data = {role: (table.column(col).to_pylist() if col in table.column_names else None) for role, col in cols.items()}
    for i in range(table.num_rows):
        keys = data["key"]
        pair = RawPair(key=str(keys[i]) if keys is not None else positional_key(path, offset + i), shard=path,
                       index=offset + i)
        if row_error is not None and (reason := row_error({c: v[i] for c, v in extras.items()})):
            pair.error = reason
            yield pair
            continue
        for role, values in data.items():
            if role == "key":
                continue
            side, kind = role.split("_")
            value = values[i]
            if kind == "image":
                if by_path[role]:
                    _fill(pair, side, *_read_image_path(root, value))
                else:
                    _fill(pair, side, *_image_value(value, root))
            elif kind == "label":
                label, err = _decode_text(None if value is None else str(value), "label")
                _fill(pair, side, spec.label_template.format(label=label) if label else None, err)
            else:
                # The same words as the tar path: a text-text pair's right side is its "second text".
                _fill(pair, side, *_decode_text(value, "second text" if side == "right" and spec.pair == "text-text"
                                                else "caption"))
        yield pair


def read_unit(spec: DatasetSpec, unit: str) -> Iterator[RawPair | UnitFailure]:
    """Pairs mode: the unit's pairs in order (index = position in its shard), then any UnitFailure,
    as the dataset's format reads them."""
    return spec.input_format.read(unit)
