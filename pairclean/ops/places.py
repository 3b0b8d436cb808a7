"""Outputs on object stores: `RemotePath`, a file or folder named by an fsspec URL (`s3://`, `gs://`,
any fsspec protocol), with the part of pathlib's API that writing an output and keeping a run's parts
use.

An object store has no rename and no exclusive create, but every object appears whole or not at all
(S3's and GCS's PUT, a multipart upload completed): a file is written to a local temp and uploaded
as one object (`ops.atomic.atomic_path`), so no reader ever sees half of one. A folder written whole
(`ops.atomic.atomic_directory`: a filtered dataset) holds `unfinished.json` from before its first
object until after its last (`UNFINISHED`), and readers refuse a folder that holds it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import posixpath
import shutil
from functools import cached_property
from pathlib import Path

from pairclean.errors import ConfigError, UserError
from pairclean.ops.extras import PROTOCOL_EXTRAS, optional

UNFINISHED = "unfinished.json"  # in a folder an output is still writing (or a killed run left unfinished)


def is_remote(url) -> bool:
    """A URL an output can be written to through fsspec (not a local spelling, not a `pipe:` command)."""
    from pairclean.ops.urls import local_path

    text = str(url)
    return isinstance(url, RemotePath) or ("://" in text and not text.startswith("pipe:") and local_path(text) is None)


class RemotePath:
    """A file or folder on an object store. Compared, hashed and shown as its URL; `/`, `name`,
    `parent`, `with_name` as pathlib's; reads and writes through the URL's fsspec filesystem, with
    listings never cached (other processes - Ray workers, torchrun ranks - write beside us)."""

    def __init__(self, url: str, fs=None):
        url = str(url).rstrip("/")
        protocol, sep, rest = url.partition("://")
        if not sep or "::" in url or not rest:
            raise UserError(f"{url} is not an object-store URL pairclean can write (PROTOCOL://BUCKET/PATH)")
        self.url, self.protocol, self.key = url, protocol, rest
        self._fs = fs

    @cached_property
    def fs(self):
        if self._fs is None:
            import fsspec

            if self.protocol in PROTOCOL_EXTRAS:
                optional(*PROTOCOL_EXTRAS[self.protocol])  # a missing one is the line naming its extra
            try:
                cls = fsspec.get_filesystem_class(self.protocol)
            except (ImportError, ValueError) as exc:
                raise UserError(f"cannot use {self.protocol}:// URLs here ({_reason(exc)}): install fsspec's "
                                f"package for {self.protocol}://") from None
            try:
                self._fs = cls(use_listings_cache=False)
            except TypeError:  # a filesystem without listing caches
                self._fs = cls()
        return self._fs

    # -- pathlib's shape ---------------------------------------------------------------------
    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(f"{self.url}/{name}", self._fs)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    @property
    def name(self) -> str:
        return posixpath.basename(self.key)

    @property
    def stem(self) -> str:
        return posixpath.splitext(self.name)[0]

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.name)[1]

    @property
    def parent(self) -> RemotePath:
        head = posixpath.dirname(self.key)
        return RemotePath(f"{self.protocol}://{head or self.key}", self._fs)

    @property
    def bucket(self) -> str:
        return self.key.split("/", 1)[0]

    def with_name(self, name: str) -> RemotePath:
        return self.parent / name

    def within(self, other: RemotePath) -> bool:
        """This path is `other` or lies under it (the guard's comparison)."""
        return self.protocol == other.protocol and (self.key == other.key or self.key.startswith(other.key + "/"))

    # -- reading -----------------------------------------------------------------------------
    def exists(self) -> bool:
        return self.fs.exists(self.key)

    def is_file(self) -> bool:
        return self.fs.isfile(self.key)

    def is_dir(self) -> bool:
        return self.fs.isdir(self.key)

    def read_bytes(self) -> bytes:
        return self.fs.cat_file(self.key)

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def open(self, mode: str = "rb"):
        return self.fs.open(self.key, mode)

    def iterdir(self) -> list[RemotePath]:
        if not self.fs.isdir(self.key):
            return []
        return [RemotePath(f"{self.protocol}://{entry.rstrip('/')}", self._fs)
                for entry in self.fs.ls(self.key, detail=False) if entry.rstrip("/") != self.key]

    def glob(self, pattern: str) -> list[RemotePath]:
        return [entry for entry in self.iterdir() if fnmatch.fnmatchcase(entry.name, pattern)]

    # -- writing (each object whole) -----------------------------------------------------------
    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Object stores have no folders: a prefix exists once an object lies under it."""

    def upload(self, local) -> None:
        self.fs.put_file(str(local), self.key)

    def write_bytes(self, data: bytes) -> None:
        self.fs.pipe_file(self.key, data)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.rm_file(self.key)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def remove_tree(self) -> None:
        """Every object under this prefix (and the object itself)."""
        if self.fs.exists(self.key):
            self.fs.rm(self.key, recursive=True)


def reachable(path: RemotePath, field: str) -> None:
    """Refuse, before any work starts, an object store that cannot be written: missing credentials,
    a bucket that does not exist, access denied (one line naming the setting)."""
    try:
        path.fs.info(path.bucket)
    except FileNotFoundError:
        raise ConfigError(f"`{field}` {path}: the bucket {path.bucket!r} does not exist (or these credentials "
                          "cannot see it); create it first", field) from None
    except Exception as exc:  # noqa: BLE001 - botocore's NoCredentialsError, gcsfs's and fsspec's errors share no base
        raise ConfigError(f"`{field}` {path}: cannot reach the object store ({_reason(exc)})", field) from None


def _reason(exc: Exception) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def readable(path) -> Path:
    """A local path to read `path` from: itself, or for a file or folder on an object store its
    mirror in pairclean's cache (what reads it needs local files: DuckDB without its network
    extensions, memory-mapped arrays read by position)."""
    from pairclean.ops.cache import cache_dir

    return local_mirror(path, cache_dir() / "mirrors") if is_remote(path) else Path(path)


def local_mirror(url, root: Path) -> Path:
    """A folder on an object store mirrored under `root` (saved embeddings: memory-mapped, read by
    position), named after the URL and what it holds (names, sizes, ETags): a folder changed since
    is mirrored afresh, an unchanged one is reused. A folder still being written is refused."""
    remote = url if isinstance(url, RemotePath) else RemotePath(str(url))
    try:
        listing = remote.fs.find(remote.key, detail=True)
    except Exception as exc:  # noqa: BLE001 - fsspec's, botocore's and gcsfs's errors share no base
        raise UserError(f"cannot read {remote}: {_reason(exc)}") from None
    if not listing:
        raise UserError(f"path not found: {remote}")
    if f"{remote.key}/{UNFINISHED}" in listing:
        raise UserError(f"{remote} is still being written (or its writer was stopped): it holds {UNFINISHED}")
    held = sorted((name, info.get("size"), str(info.get("ETag") or info.get("etag") or info.get("mtime") or ""))
                  for name, info in listing.items())
    digest = hashlib.sha1(json.dumps([remote.url, held]).encode()).hexdigest()[:16]
    target = root / f"{remote.name or 'mirror'}-{digest}"
    if not target.is_dir():
        partial = root / f".{target.name}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        for name in listing:
            local = partial / (name[len(remote.key):].lstrip("/") or remote.name)
            local.parent.mkdir(parents=True, exist_ok=True)
            remote.fs.get_file(name, str(local))
        try:
            os.replace(partial, target)
        except OSError:  # another process mirrored the same objects meanwhile: theirs is as good
            shutil.rmtree(partial, ignore_errors=True)
            if not target.is_dir():
                raise
    return target / remote.name if list(listing) == [remote.key] else target
