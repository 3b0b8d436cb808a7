"""pairclean: score, filter and train on image-text pairs with OSA weights and GMM cleanliness.

    import pairclean
    result = pairclean.score("shards/", "scores.parquet", pairclean.ScoreConfig(model="ViT-B-32"))

The public names are imported on first use, so `import pairclean` (and commands such as
`pairclean query` that never touch a model) do not pay for importing torch.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "UserError": "pairclean.errors",
    "cone_weight": "pairclean.core.scorer", "debias": "pairclean.core.scorer", "normalised_weight": "pairclean.core.scorer",
    "cosine_similarity": "pairclean.core.scorer", "WEIGHT_FUNCTIONS": "pairclean.core.scorer",
    "ScoreConfig": "pairclean.scoring.model", "score": "pairclean.scoring.model",
    "TrainConfig": "pairclean.train", "train": "pairclean.train",
    "open_dataset": "pairclean.data.dataset", "read_provenance": "pairclean.scores.contract",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pairclean' has no attribute {name!r}")
