"""Which open_clip architecture a checkpoint holds, read from its tensors' shapes.

A checkpoint loaded into the wrong architecture fails inside open_clip with a message about the
tensors ("text pos_embed width changed!"). When that happens the estimator asks this module what
the checkpoint is: the shapes of a standard CLIP state dict (ViT image tower, transformer text
tower) give the widths, depths, patch and image size, context length, vocabulary and embedding
width, and every open_clip config built from the same towers is compared with them. Checkpoints of
other towers (timm, Hugging Face text models) are described only as not matching a standard
config.
"""

from __future__ import annotations

import re
from pathlib import Path

SIGNATURE_FIELDS = ("embed_dim", "vision_width", "vision_layers", "patch_size", "image_size", "text_width",
                    "text_layers", "context_length", "vocab_size")


def _layers(names, prefix: str) -> int:
    blocks = {int(m.group(1)) for name in names if (m := re.match(re.escape(prefix) + r"(\d+)\.", name))}
    return max(blocks) + 1 if blocks else 0


def state_signature(state: dict) -> dict | None:
    """The architecture numbers of a standard open_clip CLIP state dict, None for any other."""
    dims = {"visual.conv1.weight": 4, "visual.positional_embedding": 2, "positional_embedding": 2,
            "token_embedding.weight": 2, "text_projection": 2}  # each tensor read and its dimensions
    if any(name not in state or len(getattr(state[name], "shape", ())) != ndim for name, ndim in dims.items()):
        return None  # missing, or a scalar or a vector where a matrix belongs: no architecture to name
    conv = state["visual.conv1.weight"].shape  # (width, 3, patch, patch)
    grid = round((state["visual.positional_embedding"].shape[0] - 1) ** 0.5)
    return {"embed_dim": int(state["text_projection"].shape[1]), "vision_width": int(conv[0]),
            "vision_layers": _layers(state, "visual.transformer.resblocks."), "patch_size": int(conv[-1]),
            "image_size": int(conv[-1]) * grid, "text_width": int(state["positional_embedding"].shape[1]),
            "text_layers": _layers(state, "transformer.resblocks."),
            "context_length": int(state["positional_embedding"].shape[0]),
            "vocab_size": int(state["token_embedding.weight"].shape[0])}


def config_signature(config: dict) -> dict | None:
    """The same numbers from an open_clip model config, None when its towers are not the standard ones."""
    vision, text = config.get("vision_cfg", {}), config.get("text_cfg", {})
    if any(key.startswith(("timm_", "hf_")) for key in (*vision, *text)) or not isinstance(vision.get("layers"), int):
        return None
    image = vision.get("image_size", 224)
    return {"embed_dim": config.get("embed_dim"), "vision_width": vision.get("width", 768),
            "vision_layers": vision["layers"], "patch_size": vision.get("patch_size", 16),
            "image_size": image if isinstance(image, int) else image[0], "text_width": text.get("width", 512),
            "text_layers": text.get("layers", 12), "context_length": text.get("context_length", 77),
            "vocab_size": text.get("vocab_size", 49408)}


def describe(signature: dict) -> str:
    s = signature
    return (f"a ViT of width {s['vision_width']}, {s['vision_layers']} layers, {s['patch_size']}-px patches on "
            f"{s['image_size']}-px images, a text transformer of width {s['text_width']}, {s['text_layers']} layers, "
            f"context {s['context_length']}, and {s['embed_dim']}-d embeddings")


def checkpoint_models(path: str | Path) -> tuple[list[str], str | None]:
    """(the open_clip model names whose configs match the checkpoint's shapes, what the checkpoint
    holds in words, None when it is not a standard CLIP state dict or cannot be read)."""
    import open_clip
    from open_clip.factory import get_model_config, load_state_dict

    try:
        state = load_state_dict(str(path), weights_only=True)
    except Exception:  # a file torch cannot load as a state dict: nothing to suggest, the caller's error stands
        return [], None
    signature = state_signature(state)
    if signature is None:
        return [], None
    names = [name for name in open_clip.list_models()
             if (config := get_model_config(name)) is not None and config_signature(config) == signature]
    return names, describe(signature)
