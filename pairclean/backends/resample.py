"""Resize-then-centre-crop of a whole batch of images of different sizes, as two batched matmuls.

Antialiased resampling is separable: each output row is a weighted sum of input rows, each
output column of input columns, with the weights of PIL's `ImagingResample` (torch's
`antialias=True` computes the same ones). For image n, the model's shortest-side Resize and
CenterCrop together are `Ry[n] @ X[n] @ Rx[n].T`, where `Ry[n]` (crop x H) holds the weights of
the cropped output rows and `Rx[n]` (crop x W) those of the columns. The matrices of the whole
batch are computed at once on the device from the image sizes, the images padded into one
tensor (zero weights on the padding), and the batch resized with two `torch.matmul` calls: no
per-image Python, a fixed number of kernels per batch, whatever the mix of sizes.

Like PIL, the horizontal pass comes first and its result is rounded to 8 bits before the vertical
one (a bicubic overshoot is clipped there, not carried): the result differs from PIL's only where
its fixed-point weights round otherwise (measured in docs/benchmarks.md).
"""

from __future__ import annotations

import math

import torch

from pairclean.backends.base import host_values

CHUNK_PIXELS = 64 << 20  # input pixels (x 3 channels) resized per matmul call: bounds the float32 copy


def _bicubic(x: torch.Tensor) -> torch.Tensor:
    """Keys' cubic with a = -0.5 (PIL's and torch's antialiased bicubic)."""
    a = -0.5
    x = x.abs()
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


def _bilinear(x: torch.Tensor) -> torch.Tensor:
    return (1 - x.abs()).clamp(min=0)


FILTERS = {"bicubic": (_bicubic, 2.0), "bilinear": (_bilinear, 1.0)}  # filter, support at scale 1


def max_taps(in_sizes: list[int], out_sizes: list[int], filter_name: str) -> int:
    """Input positions one output position can draw on, at most, for these resizes (computed on
    the host from the sizes, so building the weights never waits for the device)."""
    scale = max(max(i / o, 1.0) for i, o in zip(in_sizes, out_sizes))
    return math.ceil(2 * FILTERS[filter_name][1] * scale) + 2


def resize_weights(in_size: torch.Tensor, out_size: torch.Tensor, first: torch.Tensor, length: int,
                   filter_name: str, width: int, taps: int) -> torch.Tensor:
    """(N, length, width) float32: row i of image n holds the weights of output position
    `first[n] + i` of a resize from `in_size[n]` to `out_size[n]` positions over the input
    positions (0 beyond `in_size[n]`, so padded inputs add nothing). Sizes are int64 tensors;
    `taps` at least `max_taps` of them."""
    fn, base_support = FILTERS[filter_name]
    device = in_size.device
    in_f, out_f = in_size.double(), out_size.double()
    scale = (in_f / out_f)[:, None]  # (N, 1)
    support = base_support * scale.clamp(min=1.0)
    invscale = torch.where(scale >= 1.0, 1.0 / scale, torch.ones_like(scale))
    position = first[:, None].double() + torch.arange(length, device=device, dtype=torch.float64)[None, :]
    center = scale * (position + 0.5)  # (N, length)
    lo = torch.floor(center - support + 0.5).clamp(min=0)  # int() of a value >= -0.5 after the clamp
    hi = torch.minimum(torch.floor(center + support + 0.5), in_f[:, None])
    j = torch.arange(taps, device=device, dtype=torch.float64)
    source = lo[..., None] + j  # (N, length, taps): input positions
    weight = fn((source - center[..., None] + 0.5) * invscale[..., None])
    weight = torch.where(source < hi[..., None], weight, torch.zeros_like(weight))
    total = weight.sum(-1, keepdim=True)
    weight = torch.where(total != 0, weight / total, weight)
    dense = torch.zeros((len(in_size), length, width + taps), dtype=torch.float32, device=device)
    dense.scatter_add_(2, source.long(), weight.float())  # taps past the last input land in the cut-off tail
    return dense[:, :, :width]


def resized_size(height: int, width: int, size: int) -> tuple[int, int]:
    """torchvision's shortest-side Resize(size): the short side becomes `size`, the long one
    int(size * long / short)."""
    if height <= width:
        return size, int(size * width / height)
    return int(size * height / width), size


def crop_start(resized: int, crop: int) -> int:
    """CenterCrop's first row/column: int(round((size - crop) / 2)), halves to even as Python rounds."""
    return int(round((resized - crop) / 2.0))


def resize_crop(images: torch.Tensor, sizes: list[tuple[int, int]], resize: int, crop: int,
                filter_name: str = "bicubic") -> torch.Tensor:
    """uint8 (N, C, Hmax, Wmax) images, image n in its top-left `sizes[n]` = (height, width), ->
    uint8 (N, C, crop, crop): shortest-side resize to `resize`, centre crop `crop` (resize >= crop),
    as torchvision's Resize + CenterCrop on a PIL image."""
    n, channels, hmax, wmax = images.shape
    device = images.device
    resized = [resized_size(h, w, resize) for h, w in sizes]

    def weights(axis: int, width: int) -> torch.Tensor:
        given = [size[axis] for size in sizes]
        target = [size[axis] for size in resized]
        starts = [crop_start(t, crop) for t in target]
        return resize_weights(host_values(given, device), host_values(target, device), host_values(starts, device),
                              crop, filter_name, width, max_taps(given, target, filter_name))

    rows, cols = weights(0, hmax), weights(1, wmax)  # (N, crop, Hmax), (N, crop, Wmax)
    out = torch.empty((n, channels, crop, crop), dtype=torch.uint8, device=device)
    step = max(1, CHUNK_PIXELS // max(1, channels * hmax * wmax))
    for start in range(0, n, step):
        part = slice(start, start + step)
        x = images[part].float().view(-1, channels * hmax, wmax)  # (n', C*H, W)
        x = torch.bmm(x, cols[part].transpose(1, 2)).round_().clamp_(0, 255)  # columns, to 8 bits as PIL
        x = torch.matmul(rows[part][:, None], x.view(-1, channels, hmax, crop))  # rows: (n', C, crop, crop)
        out[part] = x.round_().clamp_(0, 255).to(torch.uint8)
    return out
