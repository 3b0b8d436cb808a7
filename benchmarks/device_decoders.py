"""Each device JPEG decoder's call on one batch of web JPEGs: seconds per batch, pixels against PIL.

For every `decode` name given (gpu: torchvision's nvJPEG; gpu-resize: the workers' PIL decode, not
timed, resized here; nvimgcodec; dali), the decoder is built for the model's preprocessing on
`--device` and called on the same batch: the first `--batch-size` JPEGs of the shards that the
workers would leave to the device (`device_takes`: whole, plain JPEGs), `--repeat` times after a warm-up call
(DALI builds its pipeline there). Per call: wall seconds (the device
synchronised) and the process's CPU seconds (all its threads: the libraries' own too).

Pixels are compared with PIL's: full decode, then the model's Resize and CenterCrop (what the
model gets with `decode` exact, before normalisation): the largest absolute difference and the
shares of values that differ at all and by more than 1. Reference rows: PIL on one thread, full
decode and the draft decode of `decode` fast (timed the same way); and, where DALI is installed,
the DALI pipeline one would write first (`resize_shorter` then `fn.crop`), which `decode` dali
does not use because of the pixels it gives.

    python benchmarks/device_decoders.py /work/scratchd/web --device cpu --json out.json
    python benchmarks/device_decoders.py web/ --device cuda --decoders gpu nvimgcodec --repeat 10
"""

from __future__ import annotations

import argparse
import os
import tarfile
import time
from pathlib import Path

import torch

from pairclean.backends.device_jpeg import DEVICE_DECODERS, device_takes
from pairclean.backends.inputs import ImageBatch, JpegBlob, StandardTransform
from pairclean.backends.open_clip import OpenClipPreparer
from pairclean.data.decode import decode_image
from pairclean.ops.atomic import write_json


def read_jpegs(source: Path, n: int) -> list[bytes]:
    """The first `n` image members of the shards (a folder of .tar files or the files) that the
    workers would leave for the device."""
    shards = sorted(source.glob("*.tar")) if source.is_dir() else [source]
    found: list[bytes] = []
    for shard in shards:
        with tarfile.open(shard) as tar:
            for member in tar:
                if member.name.lower().endswith((".jpg", ".jpeg")):
                    data = tar.extractfile(member).read()
                    if device_takes(data, True, 0.0):
                        found.append(data)
                        if len(found) == n:
                            return found
    return found


def timed(call, device: torch.device, repeat: int) -> tuple[object, list[float], list[float]]:
    """`call()`'s result after a warm-up, and the wall and process-CPU seconds of `repeat` calls."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    result = call()
    sync()
    walls, cpus = [], []
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        result = call()
        sync()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return result, walls, cpus


def compare(pixels: torch.Tensor, reference: torch.Tensor) -> dict:
    difference = (pixels.cpu().int() - reference.int()).abs()
    return {"max_abs_difference": int(difference.max()), "share_differing": float((difference > 0).float().mean()),
            "share_differing_by_more_than_1": float((difference > 1).float().mean())}


def dali_resize_shorter_crop(files: list[bytes], transform: StandardTransform, device: torch.device) -> torch.Tensor:
    """The DALI pipeline written from its documentation: resize the shorter side, then crop."""
    import numpy as np
    from nvidia.dali import fn, pipeline_def, types

    device_id = (device.index or 0) if device.type == "cuda" else None
    interp = types.INTERP_CUBIC if "cubic" in str(transform.interpolation) else types.INTERP_LINEAR

    @pipeline_def(batch_size=len(files), num_threads=1, device_id=device_id, prefetch_queue_depth=1)
    def pipeline():
        jpegs = fn.external_source(name="jpegs", dtype=types.UINT8, ndim=1)
        images = fn.decoders.image(jpegs, device="mixed" if device_id is not None else "cpu", output_type=types.RGB)
        images = fn.resize(images, resize_shorter=transform.resize, interp_type=interp, antialias=True)
        return fn.crop(images, crop=(transform.crop, transform.crop))

    pipe = pipeline()
    pipe.build()
    (out,) = pipe.run(jpegs=[np.frombuffer(f, dtype=np.uint8) for f in files])
    return torch.from_dlpack(out.as_tensor()).cpu().permute(0, 3, 1, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shards", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="ViT-B-32")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--decoders", nargs="+", default=["gpu", "gpu-resize", "nvimgcodec", "dali"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import open_clip

    device = torch.device(args.device)
    _, _, preprocess = open_clip.create_model_and_transforms(args.model, pretrained=None)
    transform = StandardTransform.parse(preprocess)
    files = read_jpegs(args.shards, args.batch_size)
    batch = ImageBatch(len(files), JpegBlob.pack(files), tuple(range(len(files))))
    report = {"device": str(device), "model": args.model, "jpegs": len(files), "repeat": args.repeat,
              "torch_threads": torch.get_num_threads(), "cores": len(os.sched_getaffinity(0)),
              "load_before": os.getloadavg()[0], "rows": {}}

    def pil(draft: int | None):
        return torch.stack([transform.geometry_pixels(decode_image(f, draft_size=draft)) for f in files]).permute(0, 3, 1, 2)

    reference, walls, cpus = timed(lambda: pil(None), torch.device("cpu"), args.repeat)
    report["rows"]["PIL full decode (exact)"] = {"wall_s": min(walls), "cpu_s": min(cpus), **compare(reference, reference)}
    fast, walls, cpus = timed(lambda: pil(transform.crop), torch.device("cpu"), args.repeat)
    report["rows"]["PIL draft decode (fast)"] = {"wall_s": min(walls), "cpu_s": min(cpus), **compare(fast, reference)}
    for name in args.decoders:
        cls = DEVICE_DECODERS[name]
        why = cls.unavailable()
        if why:
            report["rows"][name] = {"unavailable": why}
            continue
        decoder = cls(transform, device, preprocess)
        given = batch
        if cls.workers_decode:  # the workers' part (their preparer's) is not timed; the copy is the feed's
            workers = OpenClipPreparer(preprocess, None, draft_size=transform.crop).leaving_to(cls)
            given = workers.collate("image", [workers.prepare("image", f) for f in files]).to(device)
        (pixels, failed), walls, cpus = timed(lambda: decoder(given), device, args.repeat)
        report["rows"][name] = {"wall_s": min(walls), "cpu_s": min(cpus), "failed_rows": len(failed),
                                **compare(pixels, reference)}
        if name == "dali":
            report["rows"]["dali resize_shorter + crop (not used)"] = compare(
                dali_resize_shorter_crop(files, transform, device), reference)
    report["load_after"] = os.getloadavg()[0]

    print(f"{len(files)} JPEGs, {args.model} preprocessing, device {device}, {report['cores']} cores, "
          f"torch threads {report['torch_threads']}, load {report['load_before']:.1f} -> {report['load_after']:.1f}; "
          f"best of {args.repeat} calls")
    print(f"{'':40} {'wall s':>8} {'CPU s':>8} {'max diff':>8} {'differ':>8} {'by >1':>8}")
    for name, row in report["rows"].items():
        if "unavailable" in row:
            print(f"{name:40} {row['unavailable']}")
            continue
        times = f"{row['wall_s']:8.3f} {row['cpu_s']:8.3f}" if "wall_s" in row else f"{'-':>8} {'-':>8}"
        print(f"{name:40} {times} {row['max_abs_difference']:8d} {row['share_differing']:8.4f} "
              f"{row['share_differing_by_more_than_1']:8.5f}")
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
