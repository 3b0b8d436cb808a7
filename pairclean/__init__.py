"""pairclean: score, filter and train on image-text pairs with OSA weights and GMM cleanliness."""

__version__ = "0.1.0"

from pairclean.errors import UserError  # noqa: E402
from pairclean.scorer import cone_weight, debias, normalised_weight, WEIGHT_FUNCTIONS  # noqa: E402
from pairclean.pipeline import ScoreConfig, score  # noqa: E402

__all__ = ["UserError", "cone_weight", "debias", "normalised_weight", "WEIGHT_FUNCTIONS", "ScoreConfig", "score", "__version__"]
