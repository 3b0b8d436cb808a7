"""pairclean: score, filter and train on image-text pairs with OSA weights and GMM cleanliness.

    import pairclean
    result = pairclean.score("shards/", "scores.parquet", pairclean.ScoreConfig(model="ViT-B-32"))
    with pairclean.open_scores("scores.parquet") as scores:
        noisy = scores.table(where="gmm_noisy")
    table = pairclean.score_embeddings(image_embeddings, text_embeddings)   # arrays in, columns out

The public names are imported on first use, so `import pairclean` (and commands such as
`pairclean query` that never touch a model) do not pay for importing torch. docs/api.md
describes each.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    # scoring: a dataset into a scores file, or arrays into a table of the same columns
    "ScoreConfig": "pairclean.scoring.model", "score": "pairclean.scoring.model",
    "score_embeddings": "pairclean.scoring.arrays",
    # using a scores file
    "open_scores": "pairclean.curate.scores_file", "ScoresFile": "pairclean.curate.scores_file",
    "read_provenance": "pairclean.scorefile.contract", "read_summary": "pairclean.scorefile.contract",
    # training, datasets, errors
    "TrainConfig": "pairclean.training", "train": "pairclean.training", "open_dataset": "pairclean.data.dataset",
    "UserError": "pairclean.errors", "ConfigError": "pairclean.errors",
    # the OSA arithmetic (numpy or torch in, the same type out)
    "cosine_similarity": "pairclean.core.scorer", "debias": "pairclean.core.scorer",
    "cone_weight": "pairclean.core.scorer", "normalised_weight": "pairclean.core.scorer",
    "WEIGHT_FUNCTIONS": "pairclean.core.scorer",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pairclean' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names (what a notebook completes), not this module's machinery."""
    return sorted(__all__)
