"""Throughput helpers that keep the model busy: OOM back-off, exact text trimming, device JPEG
decode, torch.compile with an eager fallback, and loader workers whose memory stays flat.

Everything here degrades to the plain path: a CPU-only machine never needs a CUDA feature, and
a feature that fails at run time says so once and steps aside instead of ending the run.
"""

from __future__ import annotations

import ctypes
import io
import logging
import warnings
from typing import Any, Callable

import torch
from PIL import Image

from pairclean.data.decode import MAX_PIXELS, DecodeError, decode_image

log = logging.getLogger("pairclean")
if log.level == logging.NOTSET:
    # estimators.py silences the root logger (open_clip's random-init warning); ours stays audible.
    log.setLevel(logging.WARNING)

_said: set[str] = set()


def notice_once(key: str, message: str) -> None:
    """A warning printed once per process, however many batches hit the same condition."""
    if key not in _said:
        _said.add(key)
        log.warning(message)


# ---------------------------------------------------------------- loader workers

_GLIBC_M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc's malloc.h
_WORKER_MMAP_THRESHOLD = 1 << 20


def steady_worker_memory(_worker_id: int = 0) -> None:
    """DataLoader `worker_init_fn`: pin glibc's mmap threshold at 1 MiB in a loader worker.

    glibc raises that threshold after each large free (up to 32 MiB), after which batch-sized
    buffers come from the heap, which fragments and is not given back. Measured on
    benchmarks/memory_scaling.py's 10x run (80 shards, 2 workers): in 3 of 5 runs each worker
    grew from 211 to 627 MiB PSS, proportional to the shards it had read; pinned, all 5 runs
    stayed flat (peak tree PSS 967-982 MiB). Without glibc (macOS, musl) there is nothing to do.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(_GLIBC_M_MMAP_THRESHOLD, _WORKER_MMAP_THRESHOLD)


# ---------------------------------------------------------------- batches of any shape

def batch_rows(batch: Any) -> int:
    """Rows of a collated batch: a tensor, a list/tuple of rows, or a dict of such."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, dict):
        return batch_rows(next(iter(batch.values())))
    return len(batch)


def take_rows(batch: Any, rows: slice | list[int]) -> Any:
    """The same kind of batch holding only `rows` (a slice, or a list of positions)."""
    if isinstance(batch, torch.Tensor):
        return batch[rows] if isinstance(rows, slice) else batch[torch.as_tensor(rows, dtype=torch.long)]
    if isinstance(batch, dict):
        return {k: take_rows(v, rows) for k, v in batch.items()}
    if isinstance(rows, slice):
        return batch[rows]
    return type(batch)(batch[i] for i in rows)


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


class OomBackoff:
    """Encode a batch in chunks; on out-of-memory halve the chunk size and retry that chunk.

    The smaller size is kept for the rest of the run (the memory that ran out will run out
    again), and the first halving is reported once.
    """

    def __init__(self, chunk: int | None = None):
        self.chunk = chunk  # None: whole batches until the first out-of-memory
        self.halvings = 0

    def __call__(self, fn: Callable[[Any], torch.Tensor], batch: Any) -> torch.Tensor:
        n = batch_rows(batch)
        out, start = [], 0
        while start < n:
            size = min(self.chunk or n, n - start)
            part = batch if (start == 0 and size == n) else take_rows(batch, slice(start, start + size))
            try:
                out.append(fn(part))
            except Exception as exc:
                if not is_out_of_memory(exc) or size == 1:
                    raise
                del part
                self._halve(size)
                continue
            start += size
        return out[0] if len(out) == 1 else torch.cat(out)

    def _halve(self, size: int) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.chunk = max(1, size // 2)
        self.halvings += 1
        notice_once("oom", f"out of memory encoding {size} rows at once: continuing in chunks of {self.chunk} "
                           "(pass a smaller --batch-size to avoid the retry)")


# ---------------------------------------------------------------- exact text trimming

def supports_text_trim(model: torch.nn.Module) -> bool:
    """True for open_clip's CLIP text tower with causal attention and EOT (argmax) pooling.

    There the EOT position only sees the tokens before it, so padding after the longest
    caption of a batch can be cut without changing any output.
    """
    try:
        from open_clip.model import CLIP
    except ImportError:  # pragma: no cover - open_clip is a dependency
        return False
    if not isinstance(model, CLIP) or type(model).encode_text is not CLIP.encode_text:
        return False
    mask = getattr(model, "attn_mask", None)
    if model.text_pool_type != "argmax" or mask is None or mask.dim() != 2:
        return False
    causal = torch.full_like(mask, float("-inf")).triu(1)
    return bool(torch.equal(mask, causal))


def trimmed_encode_text(model: torch.nn.Module, text: torch.Tensor) -> torch.Tensor:
    """open_clip CLIP.encode_text over the first L positions, L = the last EOT of the batch + 1."""
    from open_clip.transformer import text_global_pool

    length = int(text.argmax(dim=-1).max()) + 1
    text = text[:, :length]
    cast_dtype = model.transformer.get_cast_dtype()
    x = model.token_embedding(text).to(cast_dtype)
    x = x + model.positional_embedding[:length].to(cast_dtype)
    x = model.transformer(x, attn_mask=model.attn_mask[:length, :length])
    x = model.ln_final(x)
    x = text_global_pool(x, text, model.text_pool_type)
    if model.text_projection is not None:
        x = model.text_projection(x) if isinstance(model.text_projection, torch.nn.Linear) else x @ model.text_projection
    return x


def text_buckets(text: torch.Tensor, buckets: int = 4, min_rows: int = 128) -> list[torch.Tensor]:
    """Row indices in up to `buckets` groups of similar caption length, at least `min_rows` each:
    smaller groups make each op too small to pay for its own dispatch and thread sync (measured
    on 2 CPU threads: 4 groups of 16 captions cost 2.2x the CPU of one trimmed batch of 64)."""
    parts = min(buckets, max(1, text.shape[0] // min_rows))
    if parts == 1:
        return [torch.arange(text.shape[0], device=text.device)]
    return list(text.argmax(dim=-1).argsort().tensor_split(parts))


def bucketed_encode_text(model: torch.nn.Module, text: torch.Tensor) -> torch.Tensor:
    """trimmed_encode_text per bucket of captions sorted by length, each cut at its own longest
    caption: in a large batch one long caption no longer sets the length for all. Rows come
    back in their original order, each still exact."""
    groups = text_buckets(text)
    if len(groups) == 1:
        return trimmed_encode_text(model, text)
    out = None
    for rows in groups:
        encoded = trimmed_encode_text(model, text[rows])
        if out is None:
            out = encoded.new_empty((text.shape[0], encoded.shape[1]))
        out[rows] = encoded
    return out


# ---------------------------------------------------------------- torch.compile with a fallback

class CompiledOrEager:
    """torch.compile(fn), falling back to eager `fn` (once, with a notice) if compiling fails.

    Compilation happens lazily on the first call, so that is where failures show up: a missing
    C++ compiler on CPU, an unsupported op, an old GPU.
    """

    def __init__(self, fn: Callable, name: str, dynamic: bool | None = None):
        self.eager = fn
        self.name = name
        try:
            self.compiled = torch.compile(fn, dynamic=dynamic)
        except Exception as exc:  # torch.compile itself refuses (e.g. unsupported Python)
            self._give_up(exc)

    def _give_up(self, exc: BaseException) -> None:
        self.compiled = None
        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        notice_once(f"compile-{self.name}", f"torch.compile failed for the {self.name} tower, running it eagerly: {first}")

    def __call__(self, *args):
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as exc:
                if is_out_of_memory(exc):
                    raise
                self._give_up(exc)
        return self.eager(*args)


# ---------------------------------------------------------------- JPEG decode on the device

class RawJpeg:
    """A JPEG left undecoded by a worker, to be decoded as part of a batch on the device."""

    __slots__ = ("data",)

    def __init__(self, data: torch.Tensor):
        self.data = data


def device_decodable(data: bytes, max_pixels: int = MAX_PIXELS) -> bool:
    """A JPEG whose header says nvjpeg can decode it (RGB or greyscale, within the pixel limit).

    Reads the header only; CMYK JPEGs and every other format go through PIL in the worker.
    """
    if not isinstance(data, (bytes, bytearray)) or data[:3] != b"\xff\xd8\xff":
        return False
    try:
        with Image.open(io.BytesIO(data), formats=["JPEG"]) as img:
            return img.mode in ("RGB", "L") and img.size[0] * img.size[1] <= max_pixels
    except Exception:
        return False


def collate_images(items: list) -> Any:
    """Stack worker-prepared pixels; batches holding RawJpeg rows become a dict for the device."""
    if not any(isinstance(x, RawJpeg) for x in items):
        return torch.stack(items)
    jpeg_rows = [i for i, x in enumerate(items) if isinstance(x, RawJpeg)]
    pixel_rows = [i for i, x in enumerate(items) if not isinstance(x, RawJpeg)]
    return {"jpeg": [items[i].data for i in jpeg_rows], "jpeg_rows": jpeg_rows,
            "pixels": torch.stack([items[i] for i in pixel_rows]) if pixel_rows else None,
            "pixel_rows": pixel_rows, "n": len(items)}


def _standard_transform(preprocess) -> tuple[int, int, Any, list[float], list[float]] | None:
    """(resize, crop, interpolation, mean, std) if `preprocess` is the usual open_clip eval chain:
    shortest-side Resize, CenterCrop, RGB conversion, ToTensor, Normalize; None otherwise."""
    from torchvision.transforms import CenterCrop, Normalize, Resize

    resize = crop = interpolation = mean = std = None
    for t in getattr(preprocess, "transforms", []):
        if isinstance(t, Resize):
            size = t.size if isinstance(t.size, int) else (t.size[0] if len(t.size) == 1 else None)
            if size is None or t.max_size is not None:
                return None
            resize, interpolation = size, t.interpolation
        elif isinstance(t, CenterCrop):
            if t.size[0] != t.size[1]:
                return None
            crop = t.size[0]
        elif isinstance(t, Normalize):
            mean, std = list(t.mean), list(t.std)
        elif type(t).__name__ not in ("MaybeConvertMode", "MaybeToTensor", "ToTensor") and \
                getattr(t, "__name__", "") != "_convert_to_rgb":
            return None
    if None in (resize, crop, mean):
        return None
    return resize, crop, interpolation, mean, std


class DeviceJpegDecoder:
    """Decode a batch of JPEGs with torchvision.io.decode_jpeg on the device (nvjpeg on CUDA) and
    apply the model's Resize / CenterCrop / Normalize there, as tensors.

    Pixels differ from PIL's by rounding (about one grey level); the run's provenance records
    `decode: gpu`, and a resumed run must use the same decode.
    """

    def __init__(self, preprocess, device: torch.device):
        spec = _standard_transform(preprocess)
        if spec is None:
            raise ValueError("the model's preprocessing is not Resize + CenterCrop + Normalize")
        self.resize, self.crop, self.interpolation, mean, std = spec
        self.device = device
        self.mean = torch.tensor(mean, device=device).view(3, 1, 1)
        self.std = torch.tensor(std, device=device).view(3, 1, 1)
        self.preprocess = preprocess

    @classmethod
    def supports(cls, preprocess) -> bool:
        return _standard_transform(preprocess) is not None

    def _pixels(self, image: torch.Tensor) -> torch.Tensor:
        from torchvision.transforms.v2 import functional as F

        image = F.resize(image, [self.resize], interpolation=self.interpolation, antialias=True)
        image = F.center_crop(image, [self.crop, self.crop])
        return (image.float() / 255.0 - self.mean) / self.std

    def _decode(self, datas: list[torch.Tensor]) -> list[torch.Tensor]:
        from torchvision.io import ImageReadMode, decode_jpeg

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torchvision 0.29 deprecates its image decoders
            out = decode_jpeg(datas, mode=ImageReadMode.RGB, device=self.device)
        return out if isinstance(out, list) else [out]

    def _decode_one(self, data: torch.Tensor) -> torch.Tensor:
        """One image: on the device, else PIL on this CPU (raises DecodeError)."""
        try:
            return self._pixels(self._decode([data])[0])
        except Exception:
            image = decode_image(data.numpy().tobytes())
            return self.preprocess(image).to(self.device, non_blocking=True)

    def __call__(self, batch: dict) -> tuple[torch.Tensor, dict[int, str]]:
        """(pixels for every row, zeros where decoding failed; {row: reason} for those rows)."""
        out = torch.zeros((batch["n"], 3, self.crop, self.crop), device=self.device)
        failed: dict[int, str] = {}
        try:
            for row, image in zip(batch["jpeg_rows"], self._decode(batch["jpeg"])):
                out[row] = self._pixels(image)
        except Exception:  # one bad image fails the whole batched call: redo them one by one
            for row, data in zip(batch["jpeg_rows"], batch["jpeg"]):
                try:
                    out[row] = self._decode_one(data)
                except DecodeError as exc:
                    failed[row] = str(exc)
        if batch["pixels"] is not None:
            out[batch["pixel_rows"]] = batch["pixels"].to(self.device, non_blocking=True)
        return out, failed


def finish_batch(estimator, batch: dict, left: str, right: str) -> dict:
    """Main-process step before encoding: decode RawJpeg images on the device.

    Rows whose image cannot be decoded become error rows and leave both sides' collated
    inputs, so that the two sides stay aligned.
    """
    decoder = getattr(estimator, "device_decoder", None)
    if decoder is None:
        return batch
    failed: dict[int, str] = {}
    for side, modality in (("left", left), ("right", right)):
        if modality == "image" and isinstance(batch[side], dict):
            batch[side], bad = decoder(batch[side])
            failed = {**bad, **failed}
    if failed:
        ok_rows = [i for i, e in enumerate(batch["error"]) if e is None]
        keep = [p for p in range(len(ok_rows)) if p not in failed]
        batch["left"] = take_rows(batch["left"], keep)
        batch["right"] = take_rows(batch["right"], keep)
        for pos, reason in failed.items():
            batch["error"][ok_rows[pos]] = reason
    return batch
