"""Exact text trimming for open_clip's CLIP text tower: encode only up to each batch's longest caption."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


def clip_text_tower(model: torch.nn.Module) -> bool:
    """True for a model whose text tower is open_clip's own CLIP text transformer, run by CLIP's
    own `encode_text` (not a subclass's, not a Hugging Face or timm tower)."""
    from open_clip.model import CLIP

    return isinstance(model, CLIP) and type(model).encode_text is CLIP.encode_text


def supports_text_trim(model: torch.nn.Module) -> bool:
    """True for open_clip's CLIP text tower with causal attention and EOT (argmax) pooling.

    There the EOT position only sees the tokens before it, so padding after the longest
    caption of a batch can be cut without changing any output.
    """
    if not clip_text_tower(model):
        return False
    mask = getattr(model, "attn_mask", None)
    if model.text_pool_type != "argmax" or mask is None or mask.dim() != 2:
        return False
    causal = torch.full_like(mask, float("-inf")).triu(1)
    return bool(torch.equal(mask, causal))


def token_ends(tokens: torch.Tensor) -> torch.Tensor:
    """Each caption's end: its EOT position + 1 (EOT is the largest id in CLIP's vocabulary,
    which is what argmax pooling relies on too)."""
    return tokens.argmax(dim=-1) + 1


def causal_blocks(transformer: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """open_clip's text transformer (`Transformer.forward` and each `ResidualAttentionBlock`'s) with
    the causal mask given to MultiheadAttention as booleans (True: not attended), so that in
    inference it takes its fused path (`_native_multi_head_attention`: ViT-B-32's text tower 228
    aten ops a call instead of 587 in fp32, counted on the CPU): open_clip casts its mask to the
    activations' dtype, and MultiheadAttention takes no float mask on that path. The same
    attention, computed by other kernels: outputs within float rounding of the float mask's."""
    for block in transformer.resblocks:
        q = block.ln_1(x)
        x = x + block.ls_1(block.attn(q, q, q, need_weights=False, attn_mask=mask)[0])
        x = x + block.ls_2(block.mlp(block.ln_2(x)))
    return x


FUSED_DEVICES = ("cuda",)  # where eager text towers take `causal_blocks` (a test adds "cpu" to run CUDA's path)


def fused_attention(model: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether the text tower runs `causal_blocks`: on CUDA, where each of the float mask's ~50 ops a
    block is a kernel launch the host pays for (on the H100 the eager text tower took 17.9 ms a call
    of 1,024 captions for some 3 ms of arithmetic), in inference, for open_clip's own batch-first
    blocks, not while torch.compile traces it: a compiled tower launches no op by op (and traced,
    MultiheadAttention's path guards on the cut's length, a compilation for every cut of the captions:
    `tests/test_cuda_calls.py`). A CPU keeps open_clip's path: its fp32 scores are pinned bit for bit."""
    from open_clip.transformer import ResidualAttentionBlock

    transformer = model.transformer
    return (x.device.type in FUSED_DEVICES and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and getattr(transformer, "batch_first", False)
            and not getattr(transformer, "grad_checkpointing", False)
            and all(type(b) is ResidualAttentionBlock and not hasattr(b, "ln_1_kv") for b in transformer.resblocks))


def trimmed_encode_text(model: torch.nn.Module, text: torch.Tensor, length: int, fused: bool | None = None) -> torch.Tensor:
    """open_clip CLIP.encode_text over the first `length` positions (at least the batch's last EOT + 1).
    `fused`: through `causal_blocks` (None: where `fused_attention` says)."""
    from open_clip.transformer import text_global_pool

    text = text[:, :length]
    cast_dtype = model.transformer.get_cast_dtype()
    x = model.token_embedding(text).to(cast_dtype)
    x = x + model.positional_embedding[:length].to(cast_dtype)
    mask = model.attn_mask[:length, :length]
    if fused if fused is not None else fused_attention(model, x):
        x = causal_blocks(model.transformer, x, mask < 0)
    else:  # the mask in the activations' dtype once, not cast again by each block (12 kernels fewer on CUDA)
        x = model.transformer(x, attn_mask=mask.to(x.dtype))
    x = model.ln_final(x)
    x = text_global_pool(x, text, model.text_pool_type)
    if model.text_projection is not None:
        x = model.text_projection(x) if isinstance(model.text_projection, torch.nn.Linear) else x @ model.text_projection
    return x


def text_buckets(ends: torch.Tensor, buckets: int = 4, min_rows: int = 128) -> list[torch.Tensor]:
    """Row indices in up to `buckets` groups of similar caption length (`ends`: `token_ends`), at
    least `min_rows` each: smaller groups make each op too small to pay for its own dispatch and
    thread sync (measured on 2 CPU threads: 4 groups of 16 captions cost 2.2x the CPU of one
    trimmed batch of 64)."""
    parts = min(buckets, max(1, ends.shape[0] // min_rows))
    if parts == 1:
        return [torch.arange(ends.shape[0], device=ends.device)]
    return list(ends.argsort().tensor_split(parts))


@dataclass(frozen=True)
class TextCuts:
    """How a batch of captions goes through the text tower: in up to `buckets` groups of similar
    length, each cut at its longest caption rounded up to a multiple of `step` (still exact; a
    compiled tower then sees few lengths).

    Buckets save arithmetic but multiply the ops: ViT-B-32's text tower is 612 aten ops a call in
    bf16, 2,435 for four buckets (counted on the CPU; 230 a call with CUDA's fused attention,
    `causal_blocks`). Where each op costs the host a dispatch and a
    kernel launch (eager CUDA: on the H100 the encode stage held the main thread 62 ms a batch
    of 1,024, about 3,000 ops at some 20 us), that host time, not the GPU's, bounds the run; CPUs and
    CUDA graphs (`--compile`) pay per op far less (`for_device`)."""

    buckets: int = 4
    step: int = 1

    @classmethod
    def for_device(cls, device: torch.device, compiled: bool, step: int) -> "TextCuts":
        return cls(buckets=1 if device.type == "cuda" and not compiled else 4, step=step if compiled else 1)

    def groups(self, ends: torch.Tensor, context: int) -> list[tuple[torch.Tensor, int]]:
        """(rows, cut) for each group of a batch whose captions end at `ends` (host memory)."""
        return [(rows, min(context, -(-int(ends[rows].max()) // self.step) * self.step))
                for rows in text_buckets(ends, self.buckets)]


def bucketed_encode_text(model: torch.nn.Module, text: torch.Tensor, ends: torch.Tensor,
                         encode: Callable = trimmed_encode_text, cuts: TextCuts = TextCuts()) -> torch.Tensor:
    """`encode` (trimmed_encode_text, or its compiled form) per group of captions sorted by length
    (`cuts`), each cut at its own longest caption: in a large batch one long caption no longer sets
    the length for all. Rows come back in their original order, each still exact.

    `ends` is in host memory, so the cuts and the groups are decided without reading anything back
    from the device: on CUDA such a read waits for all the work queued before it (the batch's image
    tower), and the host could not queue the next batch meanwhile."""
    groups = cuts.groups(ends.cpu(), text.shape[1])
    if len(groups) == 1:
        return encode(model, text, groups[0][1])
    out = None
    for rows, length in groups:
        rows = rows.to(text.device, non_blocking=True)
        encoded = encode(model, text[rows], length)
        if out is None:
            out = encoded.new_empty((text.shape[0], encoded.shape[1]))
        out[rows] = encoded
    return out
