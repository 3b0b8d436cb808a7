"""Train a downstream dual encoder on scored data (`pairclean train`), as a Python API.

    from pairclean.training import TrainConfig, train

    result = train(
        source,                 # shards / Parquet / manifest YAML (str or list), or a DatasetSpec
        out,                    # run directory (created; see pairclean.training.checkpoint for its files)
        TrainConfig(
            model="pairclean-tiny",  # open_clip name, or a sentence-transformers directory / "all-MiniLM-L6-v2"
            pretrained="none",       # "none" (random init) | open_clip tag | local checkpoint path
            epochs=5, batch_size=256, lr=5e-6, warmup_steps=500, seed=0,
            method="plain",          # plain | osa-weights | filter | osa-online | sdd | gsc | sps | diffncl
            method_options={},       # e.g. {"scores": "scores.parquet", "column": "weight_norm"}
        ),
        val=None,               # validation pairs: R@K/rSum each epoch, best checkpoint by rSum
        pair=None,              # override the pair kind (image-text, text-text, ...)
    ) -> TrainResult(run_dir, epochs, best_epoch, best_rsum, best_model, last_model, resumed_from, seconds)

`result.last_model` / `result.best_model` of an open_clip run is a plain state_dict:
`open_clip.create_model_and_transforms(MODEL, pretrained=str(path), weights_only=True)` loads it
(pairclean's tiny configs after `pairclean.backends.open_clip.register_model_configs()`).
Evaluate with `pairclean.training.retrieval.evaluate_retrieval(run_dir_or_model, val_shards)`.
"""

from pairclean.training.methods import (METHODS, Embeddings, LossOutput, Method, MethodContext, Shortcut, build_method,
                                     register_method)
from pairclean.training.trainer import TrainConfig, TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "train", "METHODS", "Method", "MethodContext", "Embeddings", "LossOutput",
           "Shortcut", "build_method", "register_method"]
