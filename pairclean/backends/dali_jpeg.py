"""`decode` dali: a batch's JPEGs decoded, resized and cropped by an NVIDIA DALI pipeline (`pip
install 'pairclean[gpu]'`).

The pipeline is fed the batch's encoded files (`fn.external_source`), decodes them with
`fn.decoders.image` ("mixed": nvImageCodec with the GPU's hardware decoder or nvJPEG; "cpu" on a
machine without CUDA), and resizes each straight to the model's crop with `fn.resize` over a
region of interest: the rows and columns torchvision's shortest-side Resize (long side truncated:
int(size * long / short)) and CenterCrop (start rounded half to even) would keep, computed from
each file's header inside the pipeline (`fn.peek_image_shape`). `resize_shorter` followed by
`fn.crop` does not give that geometry (DALI rounds the long side to the nearest integer and
anchors the crop otherwise): half a pixel off, it moved most pixels (docs/benchmarks.md). DALI
resamples in float without PIL's 8-bit rounding between the horizontal and vertical passes and
replicates the edge where PIL renormalises its weights, so its pixels differ from PIL's more than
`decode` gpu's do (measured in docs/benchmarks.md).

One pipeline per decoder, built for the run's batch size at the first batch and rebuilt larger
if a batch is bigger; outputs reach torch through DLPack, bound to the caller's CUDA stream, which
only DALI's dynamic executor does (`run(stream)` refuses a stream under the others: `_dynamic`).
One bad file fails DALI's whole batch: `BatchedDeviceDecoder` decodes each file alone, then PIL.
DALI logs one line per bad file on stderr (its level cannot go below errors).
"""

from __future__ import annotations

import torch

from pairclean.backends.device_jpeg import BatchedDeviceDecoder, host_threads, register_device_decoder
from pairclean.ops.records import JsonObject

INTERPOLATION = {"bicubic": "INTERP_CUBIC", "bilinear": "INTERP_LINEAR"}  # PIL's antialiased filters, DALI's names


def _crop_start(resized, crop: int):
    """CenterCrop's first row or column, int(round((resized - crop) / 2)) with Python's halves to
    even, in DALI arithmetic (it has floor, not round): (resized - crop) is an integer d >= 0;
    an odd d gives half + 0.5, rounded up when `half` is odd."""
    import nvidia.dali.math as dmath

    d = resized - crop
    half = dmath.floor(d / 2)
    return half + (d - 2 * half) * (half - 2 * dmath.floor(half / 2))


def _dynamic() -> JsonObject:
    """The pipeline keyword of DALI's dynamic executor, the one whose `run(stream)` binds its outputs
    to a CUDA stream (the others raise for a stream): `exec_dynamic`, or `experimental_exec_dynamic`
    in the DALI releases that named it so."""
    import inspect

    from nvidia.dali import Pipeline

    known = inspect.signature(Pipeline.__init__).parameters
    return {"exec_dynamic" if "exec_dynamic" in known else "experimental_exec_dynamic": True}


@register_device_decoder
class DaliJpegDecoder(BatchedDeviceDecoder):
    """`decode` dali: one DALI pipeline call per batch for decode, resize and crop."""

    name = "dali"
    version = 2  # 2: the images the workers decode (PNGs, the share) resized on the device too
    package = "nvidia-dali-cuda130"
    module = "nvidia.dali"

    def __init__(self, transform, device: torch.device, preprocess):
        super().__init__(transform, device, preprocess)
        self.device_id = (device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else None
        self.pipe, self.capacity = None, 0

    def _build(self, batch_size: int):
        """The pipeline for batches of up to `batch_size` files."""
        from nvidia.dali import fn, pipeline_def, types
        import nvidia.dali.math as dmath

        size, crop = self.transform.resize, self.transform.crop
        interp = getattr(types, INTERPOLATION[self.filter])

        @pipeline_def(batch_size=batch_size, num_threads=host_threads(), device_id=self.device_id,
                      prefetch_queue_depth=1,  # fed and run one batch at a time, by `decode_crop`
                      **(_dynamic() if self.device_id is not None else {}))
        def pipeline():
            jpegs = fn.external_source(name="jpegs", dtype=types.UINT8, ndim=1)
            shape = fn.peek_image_shape(jpegs, dtype=types.FLOAT64)  # (H, W, C) from the header
            height, width = shape[0], shape[1]
            short = dmath.min(height, width)
            # torchvision's resized size: the short side `size`, the long one truncated (exact in float64).
            resized_h, resized_w = dmath.floor(size * height / short), dmath.floor(size * width / short)
            top, left = _crop_start(resized_h, crop), _crop_start(resized_w, crop)
            scale_h, scale_w = height / resized_h, width / resized_w
            roi_start = fn.cast(fn.stack(top * scale_h, left * scale_w), dtype=types.FLOAT)
            roi_end = fn.cast(fn.stack((top + crop) * scale_h, (left + crop) * scale_w), dtype=types.FLOAT)
            images = fn.decoders.image(jpegs, device="mixed" if self.device_id is not None else "cpu",
                                       output_type=types.RGB, adjust_orientation=False)
            return fn.resize(images, size=[crop, crop], roi_start=roi_start, roi_end=roi_end, interp_type=interp,
                             antialias=True, dtype=types.UINT8)

        pipe = pipeline()
        pipe.build()
        return pipe

    def warm_up(self) -> None:
        """Nothing: the pipeline is built for the batch's size at the first batch, and one built for a
        single file would be built again there."""

    def decode_crop(self, files: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        if len(files) > self.capacity:
            self.pipe, self.capacity = self._build(len(files)), len(files)
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        (out,) = self.pipe.run(stream, jpegs=[data.numpy() for data in files])
        # (k, crop, crop, 3): HWC, as DALI's images are. Copied out: the pipeline's output buffer is
        # reused by its next run, which a failed batch's files, decoded one by one, make before they are joined.
        pixels = torch.from_dlpack(out.as_tensor()).clone()
        return pixels.permute(0, 3, 1, 2), list(range(len(files)))
