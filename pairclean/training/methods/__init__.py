"""The training methods, one module each, registered by name on import (see `base` for the interface).

Where a new method goes: a module here with an `Options` dataclass (checked in `__post_init__`), a
`Method` subclass decorated with `register_method`, its `shortcuts` if it answers to flags of its
own, and an import line below.
"""

from pairclean.training.methods.base import (METHODS, Embeddings, FollowUp, LossOutput, Method, MethodContext, Shortcut,
                                          build_method, register_method)
from pairclean.training.methods import plain, osa_weights, filter, osa_online  # noqa: F401  registers them
from pairclean.training.methods import sdd, gsc, sps, diffncl  # noqa: F401  the robust-training methods

__all__ = ["METHODS", "Embeddings", "FollowUp", "LossOutput", "Method", "MethodContext", "Shortcut", "build_method",
           "register_method"]
