"""Safe image decoding: every format PIL reads, normalised to RGB, with a decompression-bomb guard.

Runs inside DataLoader workers. A bad image raises DecodeError with a short reason that
becomes the pair's `error` value; nothing here may crash a worker.
"""

from __future__ import annotations

import functools
import io
import os
import re
import warnings

from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

# A 50,000 x 50,000 image would need 7.5 GB: refuse anything over this many pixels
# from the header alone, before any pixel buffer is allocated.
MAX_PIXELS = 178_956_970  # PIL's own hard limit (2x its warning threshold)
Image.MAX_IMAGE_PIXELS = MAX_PIXELS
ImageFile.LOAD_TRUNCATED_IMAGES = False
Image.init()
# Every format PIL reads, except EPS: PIL hands EPS data to an external Ghostscript process. The web's
# formats first: PIL tries each format in this order, and JPEG was 16th (0.035 ms of opening a file
# against 0.018, beside PIL's ~0.45 ms decode of a web JPEG); each one's magic bytes are its own.
WEB_FORMATS = tuple(f for f in ("JPEG", "PNG", "WEBP") if f in Image.OPEN)  # a Pillow without WebP has no WEBP
FORMATS = WEB_FORMATS + tuple(f for f in Image.OPEN if f != "EPS" and f not in WEB_FORMATS)
_OBJECT_REPR = re.compile(r"\s*<[^>]* at 0x[0-9a-f]+>")  # "<_io.BytesIO object at 0x7f..>": not a stable reason
EXIF_ORIENTATION = 0x0112


class DecodeError(ValueError):
    """An image that cannot be turned into pixels; the message is the row's error reason."""


def _to_rgb(img: Image.Image) -> Image.Image:
    """Flatten alpha onto white, scale 16/32-bit greyscale to 8 bit, convert palette/CMYK/LA."""
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        img = img.point(lambda v: v * (1 / 256)).convert("L") if img.mode != "I" else img.convert("F").point(lambda v: v / 256).convert("L")
    if img.mode == "P":
        img = img.convert("RGBA") if "transparency" in img.info else img.convert("RGB")
    if img.mode in ("RGBA", "LA", "PA", "RGBa"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(background, rgba)
    if img.mode != "RGB":
        img = img.convert("RGB")
    return img


def decode_image(data: bytes | None, draft_size: int | None = None, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """Bytes -> RGB PIL image (first frame of an animation).

    `draft_size`: for JPEG, let libjpeg decode at a reduced DCT scale that is still at least
    this many pixels on each side (exact enough for a later resize to that size, and several
    times cheaper for large photos).
    """
    if data is None:
        raise DecodeError("no image")
    if len(data) == 0:
        raise DecodeError("zero-byte image")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = img.size
            if width * height > max_pixels:
                raise DecodeError(f"image of {width}x{height} pixels exceeds the {max_pixels:,}-pixel limit")
            if getattr(img, "n_frames", 1) > 1:
                img.seek(0)
            if draft_size and img.format == "JPEG":
                img.draft("RGB", (draft_size, draft_size))
            img.load()
            ImageOps.exif_transpose(img, in_place=True)  # phones store photos sideways plus a rotate tag
            return _to_rgb(img)
    except DecodeError:
        raise
    except Image.DecompressionBombError as exc:
        raise DecodeError(f"decompression bomb refused: {exc}") from None
    except UnidentifiedImageError:
        raise DecodeError("cannot decode image: unknown or corrupt image format") from None
    except Exception as exc:  # PIL raises many types for corrupt data
        reason = _OBJECT_REPR.sub("", str(exc).splitlines()[0]) if str(exc) else type(exc).__name__
        raise DecodeError(f"cannot decode image: {reason[:300]}") from None


def plain_jpeg(data, draft_size: int | None = None, max_pixels: int = MAX_PIXELS, progressive: bool = True) -> bool:
    """A JPEG whose header says libjpeg's plain decode (torchvision's on the CPU, nvJPEG and the
    device decoders on a GPU) gives the pixels `decode_image` would: RGB or greyscale, within the
    pixel limit, not rotated by an EXIF tag (PIL's path applies the rotation), not one `draft_size`
    would have PIL decode at a reduced DCT scale (both sides at least twice it), and not progressive
    unless `progressive`. Reads the header only (0.004 ms, 0.02 where PIL parses it); every other
    image goes through PIL."""
    if not isinstance(data, (bytes, bytearray)) or data[:3] != b"\xff\xd8\xff":
        return False
    header = _plain_header(bytes(data))
    return (header is not None and header[0] * header[1] <= max_pixels
            and not (draft_size and min(header[0], header[1]) >= 2 * draft_size)
            and (progressive or not header[2]))


@functools.lru_cache(maxsize=1)
def _plain_header(data: bytes) -> tuple[int, int, bool] | None:
    """(width, height, progressive) of an RGB or greyscale JPEG no EXIF tag rotates, else None: from
    `_ordinary_header` where it can tell, else from PIL's parse. The last file's is kept: a worker
    with a device decoder asks twice of a JPEG it decodes itself (the device's rule, then its own)."""
    return _ordinary_header(data) or _pil_header(data)


def _pil_header(data: bytes) -> tuple[int, int, bool] | None:
    """`_plain_header` as PIL parses the header."""
    try:
        with Image.open(io.BytesIO(data), formats=["JPEG"]) as img:
            if img.mode not in ("RGB", "L") or img.getexif().get(EXIF_ORIENTATION, 1) != 1:
                return None
            return img.size[0], img.size[1], bool(img.info.get("progressive"))
    except Exception:  # any header PIL cannot parse: PIL's decode reports why
        return None


# Segments an ordinary JPEG header holds before its scan, whose parsing by PIL cannot fail once the
# whole segment is in the file and `_ordinary_header`'s checks pass: Huffman tables, quantisation
# tables (checked as PIL reads them), the restart interval, a comment, APP0 and APP2-APP15 but
# APP13 (Photoshop's resource blocks, which PIL parses). APP1 holds EXIF and XMP - an orientation
# tag - and is PIL's to read.
_ORDINARY_SEGMENTS = frozenset({0xC4, 0xDB, 0xDD, 0xFE, 0xE0, *range(0xE2, 0xED), 0xEE, 0xEF})
_ORDINARY_FRAMES = {0xC0: False, 0xC1: False, 0xC2: True}  # baseline, extended, progressive Huffman DCT


def _ordinary_header(data: bytes) -> tuple[int, int, bool] | None:
    """`_plain_header`'s answer without PIL, for the header web JPEGs have: back-to-back segments up to
    the scan, one 8-bit Huffman DCT frame of 1 or 3 components, no APP1 (so no EXIF or XMP
    orientation), nothing PIL's parse would refuse or warn about; None for any other header (PIL's
    parse answers then). Where it answers, its answer is PIL's (tested on real, rewritten and
    corrupted JPEGs), in a fifth of the time (0.004 ms against 0.02 alone; in a `fast` worker, between
    libjpeg's decode and torch's resize, PIL's parse costs more than alone: docs/benchmarks.md)."""
    size, at, end = None, 2, len(data)
    while at + 4 <= end:
        marker, length = data[at + 1], (data[at + 2] << 8) | data[at + 3]
        if data[at] != 0xFF or length < 2 or at + 2 + length > end:
            return None
        if marker == 0xDA:  # the scan: the header is over
            return size
        body = data[at + 4:at + 2 + length]
        if marker in _ORDINARY_FRAMES:
            if size is not None or length < 8 or body[0] != 8 or body[5] not in (1, 3) or length != 8 + 3 * body[5]:
                return None
            width, height = (body[3] << 8) | body[4], (body[1] << 8) | body[2]
            if not width or not height or width * height > Image.MAX_IMAGE_PIXELS:  # PIL's bomb check warns
                return None
            size = (width, height, _ORDINARY_FRAMES[marker])
        elif marker not in _ORDINARY_SEGMENTS or not _parses(marker, body):
            return None
        at += 2 + length
    return None


def _parses(marker: int, body: bytes) -> bool:
    """Whether PIL reads this segment without an error (JpegImagePlugin's `DQT` and `APP`)."""
    if marker == 0xDB:  # one or more tables of 64 one- or two-byte values, each after its id byte
        at = 0
        while at < len(body):
            at += 65 if body[at] < 16 else 129
        return at == len(body)
    if marker == 0xE0 and body.startswith(b"JFIF") or marker == 0xEE and body.startswith(b"Adobe"):
        return len(body) >= 7  # the version word PIL reads at bytes 5-6
    if marker == 0xE2:  # PIL reads an ICC fragment's sequence byte; MPF has PIL read the file as an MPO
        return not body.startswith(b"MPF\0") and (not body.startswith(b"ICC_PROFILE\0") or len(body) >= 14)
    return True


def decode_plain_jpeg(data: bytes):
    """A `plain_jpeg` decoded by torchvision's libjpeg-turbo in a DataLoader worker: uint8 (3, H, W),
    the pixels `decode_image` gives (the same on 1,000 corrupted COCO JPEGs, and the same refusals),
    in 0.32 ms against PIL's 0.45 for a web JPEG (PIL unpacks to 4-byte pixels, its array copies them
    back). None where torchvision refuses the file (PIL then decodes it or says why), where it has no
    JPEG decoder (its image codecs are deprecated since 0.29), and outside a worker: libjpeg prints
    its warnings ("Corrupt JPEG data: ...", PIL keeps them quiet) on file descriptor 2, pointed at
    /dev/null for the call - in a worker process nothing else writes meanwhile; in the main one a
    progress bar's thread might."""
    import torch

    decode = _libjpeg_decoder()
    if decode is None or torch.utils.data.get_worker_info() is None:
        return None
    stderr = os.dup(2)
    try:
        os.dup2(_devnull(), 2)
        return decode(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    except Exception:  # libjpeg's refusal: PIL's decode says why
        return None
    finally:
        os.dup2(stderr, 2)
        os.close(stderr)


@functools.cache
def _libjpeg_decoder():
    """torchvision's CPU JPEG decoder to RGB, or None without it (looked up once a process)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # superseded by TorchCodec, still shipped
            from torchvision.io import ImageReadMode, decode_jpeg
    except Exception:  # a torchvision without its image codecs: PIL decodes every image
        return None
    return lambda raw: decode_jpeg(raw, mode=ImageReadMode.RGB)


@functools.cache
def _devnull() -> int:
    return os.open(os.devnull, os.O_WRONLY)
