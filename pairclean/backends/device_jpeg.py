"""JPEG decode on the device (--decode gpu): workers leave JPEGs undecoded, the main process decodes
each batch with nvjpeg and applies the model's Resize / CenterCrop / Normalize there.

Everything degrades to the worker path: non-JPEGs and JPEGs the device cannot decode go through
PIL, and a CPU-only machine never builds a decoder (the estimator says so once).
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import torch
from PIL import Image

from pairclean.backends.oom import take_rows
from pairclean.data.decode import MAX_PIXELS, DecodeError, decode_image


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
    except Exception:  # noqa: BLE001 - PIL raises many types for a header it cannot read: the worker decodes it
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
        except Exception:  # noqa: BLE001 - nvjpeg refused it (any error type): PIL decodes it, or says why
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
    decoder = estimator.device_decoder
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
