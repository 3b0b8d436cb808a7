"""`decode` nvimgcodec: a batch's JPEGs decoded by NVIDIA nvImageCodec (`pip install
'pairclean[gpu]'`), then resized and cropped by the same two batched matmuls as `decode` gpu.

nvImageCodec picks a backend per image: the GPU's hardware JPEG decoder where there is one (A100,
H100), nvJPEG's CUDA decoder, or libjpeg-turbo on the CPU for what neither takes; on a machine
without CUDA (and in the pipeline-only benchmark on a CPU) its CPU backend alone. Its decode has
no resize (DecodeParams holds only orientation, colour and sample format), so the decoded images
go to `resize_many` as they are, without a copy: planar RGB, seen by torch through DLPack (device
memory) or the array interface (host memory). Its CPU backend gives PIL's pixels exactly
(libjpeg-turbo both); the resize differs from PIL's as `decode` gpu's does (docs/benchmarks.md).

A file it cannot decode comes back as None, not as a failed batch, so a bad file costs no retry;
a call that gave fewer images than files (which row is which could not be told) counts as failed,
and each file is then decoded alone (`BatchedDeviceDecoder`).
Its own log line per such file is silenced (PYNVIMGCODEC_VERBOSITY=0 unless set): the row's error
says what PIL found. Silenced too would be its one line saying its GPU decoders did not load
(they need libnvjpeg: the `nvjpeg` extra of its package, which pairclean[gpu] installs), after
which every image quietly takes its CPU decoder; a probe decode on the GPU at start says so.
"""

from __future__ import annotations

import functools
import io
import os

import numpy as np
import torch
from PIL import Image

from pairclean.backends.device_jpeg import BatchedDeviceDecoder, host_threads, register_device_decoder
from pairclean.ops.notices import notice_once


@register_device_decoder
class NvImageCodecDecoder(BatchedDeviceDecoder):
    """`decode` nvimgcodec: nvImageCodec's batched decode (all its backends on CUDA, its CPU one
    elsewhere), then `resize_many`."""

    name = "nvimgcodec"
    version = 2  # 2: the images the workers decode (PNGs, the share) resized on the device too
    package = "nvidia-nvimgcodec-cu13"
    module = "nvidia.nvimgcodec"

    @classmethod
    def load(cls):
        """nvImageCodec without its log line per bad file: it reads the variable when it loads."""
        os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")
        return super().load()

    def __init__(self, transform, device: torch.device, preprocess):
        super().__init__(transform, device, preprocess)
        nvimgcodec = self.library = self.load()
        # EXIF-rotated JPEGs never get here (`plain_jpeg`); greyscale ones come out as RGB, as PIL converts them.
        self.params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB,
                                              sample_format=nvimgcodec.SampleFormat.P_RGB)
        self.index = None
        if device.type == "cuda":
            self.index = device.index if device.index is not None else torch.cuda.current_device()
            if not self._gpu_decodes(self.index):
                notice_once("decode-nvimgcodec-cpu", "`decode` nvimgcodec: nvImageCodec's GPU decoders did not load "
                            "here (no libnvjpeg: pip install 'nvidia-nvimgcodec-cu13[nvjpeg]'); its CPU decoder "
                            "decodes the JPEGs instead", "decode")

    @functools.cached_property
    def decoder(self):
        """nvImageCodec's decoder, made at the first batch (or the warm-up): the DataLoader has started
        its workers by then, so its host threads are the cores they leave (`host_threads`)."""
        nvimgcodec = self.library
        if self.index is not None:
            return nvimgcodec.Decoder(device_id=self.index, max_num_cpu_threads=host_threads())
        return nvimgcodec.Decoder(device_id=nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY, max_num_cpu_threads=host_threads(),
                                  backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.CPU_ONLY)])

    def _gpu_decodes(self, index: int) -> bool:
        """Whether a decoder restricted to one of the device's backends (the hardware decoder, the
        CUDA one, the hybrid) decodes a small JPEG here. A backend that cannot be created on this
        device (nvImageCodec raises: an H100 gave 'Could not create decoder. Code: 7' for GPU_ONLY)
        is one that does not decode."""
        nvimgcodec, encoded = self.library, io.BytesIO()
        Image.new("RGB", (64, 64), (200, 40, 40)).save(encoded, format="JPEG")
        for kind in ("HW_GPU_ONLY", "GPU_ONLY", "HYBRID_CPU_GPU"):
            try:
                probe = nvimgcodec.Decoder(device_id=index, backends=[nvimgcodec.Backend(getattr(nvimgcodec.BackendKind, kind))])
                if probe.decode(nvimgcodec.CodeStream(encoded.getvalue()), params=self.params) is not None:
                    return True
            except (RuntimeError, AttributeError):
                continue
        return False

    def _stream(self) -> int:
        """The CUDA stream decoding is ordered on: the caller's current one (0: none, on a CPU)."""
        return torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0

    def _tensor(self, image) -> torch.Tensor:
        """An nvImageCodec image as a uint8 (3, H, W) tensor on the device, sharing its memory."""
        if image.buffer_kind == self.library.ImageBufferKind.STRIDED_DEVICE:
            return torch.from_dlpack(image)  # ready on our stream: the decode call was ordered on it
        # Host memory, page-locked by nvImageCodec and freed with the image: a view, or on CUDA a copy
        # that completes before the call returns (an asynchronous one could outlive the image's memory)
        return torch.from_numpy(np.asarray(image)).to(self.device)

    def decode_crop(self, files: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        streams, parsed = [], []
        for position, data in enumerate(files):
            try:
                streams.append(self.library.CodeStream(data.numpy()))
                parsed.append(position)
            except RuntimeError:  # a header it cannot parse: PIL's turn
                pass
        images = self.decoder.decode(streams, params=self.params, cuda_stream=self._stream()) if streams else []
        if len(images) != len(streams):  # no image a stream: which row each one is cannot be told
            raise RuntimeError(f"nvImageCodec gave {len(images)} images for {len(streams)} files")
        decoded = [(position, image) for position, image in zip(parsed, images) if image is not None]
        if not decoded:
            crop = self.transform.crop
            return torch.empty((0, 3, crop, crop), dtype=torch.uint8, device=self.device), []
        pixels = self.resized([self._tensor(image) for _, image in decoded])
        return pixels, [position for position, _ in decoded]
