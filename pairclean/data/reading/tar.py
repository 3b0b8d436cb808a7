"""Tar shards, read in stages: members -> samples -> pairs.

    tar_members   the shard's members in archive order, less the skipped ones (one member-skip
                  rule), each read by the mode's `ReadMember`; then what ended the shard early
    samples       the grouping rule: consecutive members with one key make a sample, numbered by
                  its position in the shard (the row's `index`)
    sample_pair   a sample -> a RawPair, through the dataset's fields (`reading.values`)

Three modes read with the same two rules, so every command numbers rows alike: pairs
(`tar_pairs`: scoring, training, the report), as stored (`read_samples`: filter and corrupt copy
members byte for byte), and header-only sizes (`list_samples`: counts, keys, filter's dry run).

Member names are split by webdataset's `base_plus_ext`, but members are read and grouped here
rather than by `tarfile_samples`, because that silently loses data on three hostile inputs:
tarfile ends without an error on a truncated or corrupt member *header*, a repeated key
(`a.jpg a.txt a.jpg a.txt`) makes `group_by_keys` drop the second pair, and a member of any size
is read into memory.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from webdataset.tariterators import base_plus_ext, meta_prefix, meta_suffix

from pairclean.data.reading.inputs import open_input
from pairclean.data.reading import values
from pairclean.data.reading.values import Oversized, decode_text, fill
from pairclean.data.spec import DatasetSpec, OnFailure, RawPair, UnitFailure
from pairclean.ops.urls import is_local, not_regular

_SKIP_META = re.compile(r"__[^/]*__($|/)")  # webdataset's tar_file_iterator skip_meta


@dataclass
class Sample:
    """A tar sample as stored: member suffix (case kept) -> bytes (`read_samples`) or size (`list_samples`)."""

    key: str
    shard: str
    index: int
    members: dict[str, bytes | int]


# -- stage 1: members ----------------------------------------------------------------------------


class _HeaderWatch(tarfile.TarInfo):
    """tarfile ends its member loop *silently* on an empty, truncated or corrupt header; a
    subclass made per archive remembers which header error ended the loop.

    It wraps `fromtarfile`, the public classmethod `TarFile.next()` calls for every header, not
    `frombuf`: newer tarfiles (seen: Ubuntu's Python 3.12.3 build) route `fromtarfile` through
    private `_fromtarfile`/`_frombuf`, so a `frombuf` hook never saw the end-of-archive marker
    and every whole shard looked truncated."""

    stop: Exception | None = None

    @classmethod
    def fresh(cls) -> type["_HeaderWatch"]:
        """A watch for one archive, its `stop` its own."""
        return type("_Watch", (cls,), {})

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


def error_line(exc: BaseException) -> str:
    """An exception as one short line: its type and first line."""
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


def stored_size(info: tarfile.TarInfo) -> int:
    """The bytes a member's data takes in the archive: its size, or a sparse member's chunks."""
    return sum(chunk for _, chunk in info.sparse) if info.issparse() else info.size


def present_size(archive: tarfile.TarFile, info: tarfile.TarInfo) -> int:
    """Header mode: the member's size once its last byte is known to be in the file, so that a
    member whose data is cut off ends the listing where reading it ends the other modes. A sparse
    member (GNU tar's `--sparse`) stores only its chunks, back to back: `size` counts its holes too."""
    stored = stored_size(info)
    if stored:
        archive.fileobj.seek(info.offset_data + stored - 1)
        if not archive.fileobj.read(1):
            raise tarfile.ReadError("unexpected end of data")
    return info.size


class RefusedMember(Exception):
    """A member raw mode will not copy; its message is the shard's failure reason (`tar_members`)."""


def refuse_uncopyable(info: tarfile.TarInfo) -> None:
    """The copy's rule (raw mode, and filter's dry run that foretells it): a sparse member over the
    pairs mode's cap is refused, since its copy is its full size, holes written out, and a few
    stored bytes can declare terabytes."""
    if info.issparse() and info.size > values.MAX_MEMBER_BYTES:
        raise RefusedMember(f"member {info.name} is a sparse file of {info.size:,} bytes "
                            f"({stored_size(info):,} stored), over the {values.MAX_MEMBER_BYTES:,}-byte limit of "
                            "a copy; the rest of the shard was not read")


# Members are read in pieces of at most this size, so a header's claim allocates nothing beyond the
# bytes that are there (a cut member claiming 40 GB failed as "MemoryError").
RAW_READ_PIECE = 64 << 20


def whole_bytes(archive: tarfile.TarFile, info: tarfile.TarInfo) -> bytes:
    """Raw mode: the member's bytes whatever their size, since a copy must be complete (pairs mode's
    below its cap). Read from the archive's file where its data starts; a sparse member's through
    tarfile's file object (`extractfile`), which maps its holes - that object and the buffered
    reader over it were a fifth of a worker's tar reading (docs/benchmarks.md); one the copy's rule
    refuses is not read (`refuse_uncopyable`)."""
    if info.issparse():
        refuse_uncopyable(info)
        return archive.extractfile(info).read()
    archive.fileobj.seek(info.offset_data)
    pieces, left = [], info.size
    while left and (piece := archive.fileobj.read(min(left, RAW_READ_PIECE))):
        pieces.append(piece)
        left -= len(piece)
    data = b"".join(pieces)  # one piece: that piece, not a copy
    if len(data) != info.size:
        raise tarfile.ReadError("unexpected end of data")  # tarfile's own words for a cut member
    return data


def capped_bytes(archive: tarfile.TarFile, info: tarfile.TarInfo) -> bytes | Oversized:
    """Pairs mode: the member's bytes, or a stand-in when it is too big to hold in memory."""
    if info.size > values.MAX_MEMBER_BYTES:
        present_size(archive, info)
        return Oversized(info.name, info.size)
    return whole_bytes(archive, info)


ReadMember = Callable[[tarfile.TarFile, tarfile.TarInfo], object]
Member = tuple[str, object]  # (member name, what ReadMember made of it)


def tar_members(url: str, member: ReadMember, allow_pipe: bool) -> Iterator[Member | UnitFailure]:
    """(name, member(archive, info)) of the shard's members in archive order, less the skipped
    ones; then, last, a UnitFailure for whatever ended the shard early (a vanished file, an
    unreadable stream, a truncated or corrupt tar, a failing `pipe:`/curl). A local shard is opened
    for random access where it can be (`_opened_archive`)."""
    problem = _refusal(url, allow_pipe)
    if problem:
        yield problem
        return
    members = 0
    stream = None
    reason = None
    try:
        stream = open_input(url)
        with _opened_archive(stream, is_local(url)) as archive:
            for info in archive:
                archive.members = []  # tarfile keeps every TarInfo otherwise
                if _skipped(info):
                    continue
                members += 1
                yield info.name, member(archive, info)
        reason = _end_of_archive_problem(archive.tarinfo.stop, members)
    except RefusedMember as exc:
        reason = str(exc)
    except tarfile.ReadError as exc:
        reason = (f"truncated tar: the file ends inside member data after {members} member(s)"
                  if "unexpected end" in str(exc) else f"unreadable tar: {error_line(exc)}")
    except Exception as exc:  # any way a shard can break (gopen, fsspec, gzip, a pipe): the rows read so far are kept
        reason = error_line(exc)
    finally:
        if stream is not None:
            try:
                stream.close()  # a pipe's exit status is checked here
            except Exception as exc:  # a pipe's non-zero exit, a remote stream's close: the shard failed
                reason = reason or error_line(exc)
    if reason:
        yield UnitFailure(url, reason)


def _opened_archive(stream, seekable: bool) -> tarfile.TarFile:
    """The archive over `stream`, its headers read by a `_HeaderWatch` of its own (`archive.tarinfo`):
    a seekable, uncompressed tar for random access - its members' data read where it lies
    (`whole_bytes`) or seeked over (`present_size`), not copied through tarfile's stream buffer;
    else, and for a compressed or unreadable file, as a stream, whose compression tarfile detects
    and whose errors say what is wrong with the file."""
    if seekable:
        try:
            return tarfile.open(fileobj=stream, mode="r:", tarinfo=_HeaderWatch.fresh())
        except tarfile.ReadError:  # compressed, or not a tar: its first header did not parse
            stream.seek(0)
    return tarfile.open(fileobj=stream, mode="r|*", tarinfo=_HeaderWatch.fresh())


# -- stage 2: samples ----------------------------------------------------------------------------


def samples(url: str, members: Iterable[Member | UnitFailure]) -> Iterator[Sample | UnitFailure]:
    """The grouping rule: consecutive members with one key make a sample, as in webdataset's
    `group_by_keys`, except that a suffix already in the sample (compared case-blind) starts a new
    one: keys may repeat, even back to back, and each occurrence is its own row. A failure comes
    after every sample before the break (the last sample is only complete when the members end)."""
    key, sample, index, failure = None, {}, 0, None
    for item in members:
        if isinstance(item, UnitFailure):
            failure = item
            continue
        name, value = item
        prefix, suffix = base_plus_ext(name)
        if prefix is None:
            continue
        if sample and (prefix != key or suffix.lower() in {s.lower() for s in sample}):
            yield Sample(key, url, index, sample)
            index, sample = index + 1, {}
        key = prefix
        sample[suffix] = value
    if sample:
        yield Sample(key, url, index, sample)
    if failure is not None:
        yield failure


def applying(policy: OnFailure, items: Iterable[Sample | UnitFailure]) -> Iterator[Sample]:
    """The samples, each failure handed to the caller's error policy (which returns or raises)."""
    for item in items:
        if isinstance(item, UnitFailure):
            policy(item)
        else:
            yield item


def read_samples(url: str, on_failure: OnFailure, allow_pipe: bool = False) -> Iterator[Sample]:
    """Raw mode: the tar shard's samples with every member's bytes exactly as stored."""
    return applying(on_failure, samples(url, tar_members(url, whole_bytes, allow_pipe)))


def list_samples(url: str, on_failure: OnFailure, allow_pipe: bool = False,
                 read: tuple[str, ...] = (), copy: bool = False) -> Iterator[Sample]:
    """Header mode: the tar shard's samples with each member's size in bytes; a local shard's
    member data is seeked over, not read, except members with a suffix in `read` (e.g. `json`,
    to take a key from it), whose bytes are given (capped like pairs mode). `copy`: the listing
    ends where raw mode's copy would (`refuse_uncopyable`), for a dry run that foretells it."""
    wanted = {suffix.lower() for suffix in read}

    def member(archive: tarfile.TarFile, info: tarfile.TarInfo):
        if copy:
            refuse_uncopyable(info)
        if wanted and (suffix := base_plus_ext(info.name)[1]) and suffix.lower() in wanted:
            return capped_bytes(archive, info)
        return present_size(archive, info)

    return applying(on_failure, samples(url, tar_members(url, member, allow_pipe)))


# -- stage 3: pairs ------------------------------------------------------------------------------


def json_value(members: dict, name: str):
    """A value of the sample's json member (None when there is no member, no such key, or no JSON)."""
    raw = members.get("json")
    if raw is None or isinstance(raw, (Oversized, int)):
        return None
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the parser's depth
        return None
    return obj.get(name) if isinstance(obj, dict) else None


def sample_key(key_field: str | None, raw: Sample) -> str:
    """A tar sample's key: its member names' prefix (`__key__`), or a key of its json member
    (DataComp's `uid`), falling back to the prefix when the member lacks it."""
    if key_field in (None, "__key__"):
        return raw.key
    value = json_value({s.lower(): v for s, v in raw.members.items()}, key_field)
    return raw.key if value is None else str(value)


def _text(sample: dict, ext: str, json_key: str | None) -> tuple[str | None, str | None]:
    if ext in sample:
        if isinstance(sample[ext], Oversized):
            return None, sample[ext].reason
        return decode_text(sample[ext], "caption")
    if json_key and "json" in sample:
        if isinstance(sample["json"], Oversized):
            return None, sample["json"].reason
        try:
            obj = json.loads(sample["json"])
        except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the parser's depth
            obj = None
        if not isinstance(obj, dict):
            return None, "json member is not valid JSON"
        value = obj.get(json_key)
        return decode_text(value if value is None or isinstance(value, str) else str(value), "caption")
    return None, "missing caption"


def _image(sample: dict, candidates: list[str]) -> tuple[bytes | None, str | None]:
    for ext in candidates:
        if ext in sample:
            if isinstance(sample[ext], Oversized):
                return None, sample[ext].reason
            return sample[ext], None
    return None, f"no image member (looked for {', '.join(candidates)})"


def sample_pair(spec: DatasetSpec, raw: Sample) -> RawPair:
    """A sample's two sides, read through the dataset's fields (member suffixes compared case-blind)."""
    f = spec.fields
    pair = RawPair(key=sample_key(f.key, raw), shard=raw.shard, index=raw.index)
    sample = {suffix.lower(): value for suffix, value in raw.members.items()}
    if spec.pair in ("image-text", "image-label", "image-image"):
        fill(pair, "left", *_image(sample, f.image_candidates()))
    if spec.pair == "image-text":
        fill(pair, "right", *_text(sample, f.text, f.json_text_key))
    elif spec.pair == "image-label":
        label, err = _text(sample, f.label, None)
        fill(pair, "right", spec.label_template.format(label=label) if label else None,
             err and err.replace("caption", "label"))
    elif spec.pair == "image-image":
        fill(pair, "right", *_image(sample, f.image_candidates(second=True)))
    elif spec.pair == "text-text":
        fill(pair, "left", *_text(sample, f.text, f.json_text_key))
        second, err = _text(sample, f.text2, None)
        fill(pair, "right", second, err and err.replace("caption", "second text"))
    return pair


def tar_pairs(spec: DatasetSpec, unit: str) -> Iterator[RawPair | UnitFailure]:
    """Pairs mode: the shard's pairs in order, then its failure, if any."""
    for item in samples(unit, tar_members(unit, capped_bytes, spec.allow_pipe)):
        yield item if isinstance(item, UnitFailure) else sample_pair(spec, item)
