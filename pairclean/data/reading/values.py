"""One stored value -> one side of a pair, with the reason when it cannot be one.

Every reader turns values into sides here, so a caption is decoded, stripped and cut alike from a
tar member or a Parquet column, and an image comes as bytes whether it was a member, a column, a
Hugging Face Image struct or a file named by path under the dataset root.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from pairclean.data.spec import RawPair
from pairclean.ops.urls import file_kind

# Text encoders keep the first 77 (CLIP) or 256 (MiniLM) tokens, far fewer than 4096 characters;
# a longer caption only costs tokeniser time (CLIP's BPE is quadratic in the length of a word).
MAX_TEXT_CHARS = 4096
MAX_SHOWN = 120  # characters of a stored value an error message quotes (never an image's bytes)
MAX_MEMBER_BYTES = 256 << 20  # a tar member or image file bigger than this is refused without being read


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


class Oversized:
    """Stands in for a tar member (or image file) that was too big to read."""

    def __init__(self, name: str, size: int, what: str = "member"):
        self.reason = f"{what} {name} is {size:,} bytes, over the {MAX_MEMBER_BYTES:,}-byte limit"


def decode_text(raw: bytes | str | None, what: str) -> tuple[str | None, str | None]:
    """(the text, None) or (None, why it is no text): UTF-8, stripped, cut to MAX_TEXT_CHARS."""
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


def fill(pair: RawPair, side: str, value, error) -> None:
    """Set one side of the pair; the first reason a side could not be read becomes the pair's error."""
    setattr(pair, side, value)
    if error and pair.error is None:
        pair.error = error


def safe_join(root: Path, relative: str) -> Path | None:
    """Resolve a path from a Parquet column under the dataset root; None if it escapes the root."""
    root = root.resolve()
    candidate = (root / relative).resolve()
    return candidate if candidate == root or root in candidate.parents else None


def read_image_path(root: Path, value) -> tuple[bytes | None, str | None]:
    """The bytes of the image file a column names, under `root`, or why there are none."""
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
            return None, Oversized(str(value), info.st_size, "image file").reason
        try:
            data = fh.read(MAX_MEMBER_BYTES + 1)
        except OSError as exc:
            return None, f"cannot read image file {shown(value)}: {exc.strerror or exc}"
    if len(data) > MAX_MEMBER_BYTES:  # it grew after the check
        return None, Oversized(str(value), len(data), "image file").reason
    return data, None


def image_value(value, root: Path) -> tuple[bytes | None, str | None]:
    """An image column's value: bytes, or a Hugging Face `Image` struct {bytes, path} (bytes when
    embedded, else the file at path under the dataset root)."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value), None
    if value is None:
        return None, "missing image"
    if isinstance(value, dict) and {"bytes", "path"} <= set(value):
        if value["bytes"] is not None:
            return value["bytes"], None
        return read_image_path(root, value["path"])
    kind = shown(value) if isinstance(value, dict) else type(value).__name__
    return None, f"image column holds {kind}, not image bytes"
