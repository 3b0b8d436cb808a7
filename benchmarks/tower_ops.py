"""The towers' aten ops a call and their bf16 numerics, the way each runs: under autocast or in its stored weights.

    python benchmarks/tower_ops.py                       # ViT-B-32, the 239 COCO-mini pairs, CPU
    python benchmarks/tower_ops.py --model RN50 --pairs 64 --json ops.json
    python benchmarks/tower_ops.py SHARDS/manifest.yaml --pairs 1024 --device cuda   # gpu_figures.sh runs it

On eager CUDA every aten op costs the host a dispatch and a kernel launch, so the ops a batch
bound the main thread (docs/benchmarks.md, "After the H100 call"). Four ways, on this CPU, with
the same weights:
  autocast, fused MHA off  - what CUDA ran before: `nn.MultiheadAttention` leaves its fused path
                             whenever CUDA autocast is on (`torch.is_autocast_enabled()`)
  autocast                 - what ran before where it runs (on a CPU, whose autocast leaves the
                             fused path alone; on CUDA the same computation as the row above)
  stored dtype, text float mask - open_clip's own transformer towers in their stored bf16
                             weights, autocast off (`estimator.autocast`), the text tower's causal
                             mask in floats as open_clip gives it (session 17)
  as built                 - what `OpenClipEstimator` runs now: the same, the text tower's mask as
                             booleans on CUDA, for MHA's fused path (`text_trim.causal_blocks`)
Each way's sims (image . caption, L2-normalised) are compared with an fp32 copy of the model and
with each other: the rounding a change of way brings; and each tower call is timed (median of
`--repeat`, the device synchronised). SOURCE: a COCO-mini directory (pairs.jsonl + images) or any
image-text dataset `pairclean score` reads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pairclean.backends import text_trim
from pairclean.backends.inputs import TokenBatch
from pairclean.backends.open_clip import OpenClipEstimator, _matmul_weights_to
from pairclean.data.dataset import as_dataset
from pairclean.lab.coco import read_pairs
from pairclean.bench.score import sample_items

COCO_MINI = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "coco-mini"


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it (those the host launches one by one on eager CUDA)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def way(estimator: OpenClipEstimator, autocast: dict[str, bool] | None, fused_attention: bool, text_fused: bool = True):
    """`estimator` run another way for a while: towers under autocast or not, MHA's fused path on or
    off, the text tower's causal mask as booleans where `text_trim.fused_attention` says (session 18)
    or always open_clip's float mask (`text_fused` False)."""
    built, fused, chooser = estimator.autocast, torch.backends.mha.get_fastpath_enabled(), text_trim.fused_attention
    estimator.autocast = autocast or built
    torch.backends.mha.set_fastpath_enabled(fused_attention)
    if not text_fused:
        text_trim.fused_attention = lambda model, x: False
    try:
        yield
    finally:
        estimator.autocast = built
        torch.backends.mha.set_fastpath_enabled(fused)
        text_trim.fused_attention = chooser


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def encode(estimator: OpenClipEstimator, pixels: torch.Tensor, tokens, repeat: int) -> tuple[torch.Tensor, dict, dict]:
    """Each pair's sim; the aten ops of one call of each tower; its median ms a call."""
    ops, ms, out = {}, {}, {}
    for modality, batch in (("image", pixels), ("text", tokens)):
        with OpCounter() as counter:
            out[modality] = estimator.encode(modality, batch)  # also the warm-up call
        ops[modality] = counter.ops
        times = []
        for _ in range(repeat):
            synchronize(estimator.device)
            started = time.perf_counter()
            estimator.encode(modality, batch)
            synchronize(estimator.device)
            times.append((time.perf_counter() - started) * 1000)
        ms[modality] = statistics.median(times) if times else None
    return (out["image"] * out["text"]).sum(-1).cpu(), ops, ms


def read_source(source: Path, n: int) -> tuple[list[bytes], list[str]]:
    """Up to `n` (JPEG bytes, caption) pairs of a COCO-mini directory or of an image-text dataset."""
    if (source / "pairs.jsonl").is_file():
        pairs = read_pairs(source, limit=n)
        return [(source / p["image"]).read_bytes() for p in pairs], [p["caption"] for p in pairs]
    items = sample_items(as_dataset(str(source)), n)
    return [item.left for item in items], [item.right for item in items]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, nargs="?", default=COCO_MINI)
    parser.add_argument("--model", default="ViT-B-32")
    parser.add_argument("--pairs", type=int, default=239, help="one batch of this many pairs")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=3, help="timed calls of each tower, each way")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    reference = OpenClipEstimator(args.model, pretrained="none", device=args.device, precision="fp32")
    bf16 = OpenClipEstimator(args.model, pretrained="none", device=args.device, precision="bf16")
    bf16.model.float().load_state_dict(reference.model.state_dict())  # the same weights, then stored as bf16 again
    _matmul_weights_to(bf16.model, torch.bfloat16)

    images, captions = read_source(args.source, args.pairs)
    prep = reference.preparer
    pixels = prep.collate("image", [prep.prepare("image", jpeg) for jpeg in images])
    tokens = prep.collate("text", [prep.prepare("text", caption) for caption in captions])
    # on the device before the timing (the caption ends stay in host memory, as the workers send them)
    pixels, tokens = pixels.to(reference.device), TokenBatch(tokens.tokens.to(reference.device), tokens.ends)

    fp32, fp32_ops, fp32_ms = encode(reference, pixels, tokens, args.repeat)
    ways = {"autocast, fused MHA off (before, CUDA)": ({"image": True, "text": True}, False, True),
            "autocast (before)": ({"image": True, "text": True}, True, True),
            "stored dtype, text float mask (session 17)": (None, True, False),
            "as built (now)": (None, True, True)}
    sims, rows = {}, []
    for name, (autocast, fused, text_fused) in ways.items():
        try:  # a way that fails (on a device, say) is reported as such; the others still are
            with way(bf16, autocast, fused, text_fused):
                sims[name], ops, ms = encode(bf16, pixels, tokens, args.repeat)
        except Exception as exc:  # any failure of a way is its result
            rows.append({"way": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"})
            continue
        diff = (sims[name] - fp32).abs()
        rows.append({"way": name, "image_ops": ops["image"], "text_ops": ops["text"], "image_ms": ms["image"],
                     "text_ms": ms["text"], "max_abs_dsim_vs_fp32": float(diff.max()),
                     "mean_abs_dsim_vs_fp32": float(diff.mean())})
    names = list(sims)
    between = {f"{a} | {b}": float((sims[a] - sims[b]).abs().max()) for i, a in enumerate(names) for b in names[i + 1:]}

    def shown(value):
        return "-" if value is None else f"{value:.1f}"

    print(f"{args.model}, {len(images)} pairs of {args.source}, bf16 on {bf16.device}; "
          f"towers under autocast as built: {bf16.autocast}")
    print(f"fp32: image {fp32_ops['image']} ops {shown(fp32_ms['image'])} ms, text {fp32_ops['text']} ops "
          f"{shown(fp32_ms['text'])} ms a call")
    for r in rows:
        if "error" in r:
            print(f"{r['way']:44s} failed: {r['error']}")
            continue
        print(f"{r['way']:44s} image {r['image_ops']:4d} ops {shown(r['image_ms']):>7s} ms  text {r['text_ops']:4d} ops "
              f"{shown(r['text_ms']):>7s} ms  max |dsim| vs fp32 {r['max_abs_dsim_vs_fp32']:.2e} "
              f"(mean {r['mean_abs_dsim_vs_fp32']:.1e})")
    for pair, value in between.items():
        print(f"max |dsim| {pair}: {value:.2e}")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "pairs": len(images), "device": str(bf16.device),
                                         "autocast": bf16.autocast, "fp32_ops": fp32_ops, "fp32_ms": fp32_ms,
                                         "ways": rows, "max_abs_dsim_between": between}, indent=2))


if __name__ == "__main__":
    main()
