"""Encoder backends: the frozen estimators and trainable targets behind one protocol and one registry.

Importing the package registers the built-in backends (open_clip, sentence-transformers); see
`pairclean.backends.base` for the protocol and how to add one. It also registers the device JPEG
decoders of NVIDIA's libraries (`device_jpeg` holds their registry; their packages load only when
one is chosen).
"""

from pairclean.backends import open_clip, sentence_transformers  # noqa: F401  (registers the built-in backends)
from pairclean.backends import dali_jpeg, nvimgcodec_jpeg  # noqa: F401  (registers the `decode` dali and nvimgcodec)
from pairclean.backends.base import (BACKENDS, Backend, Estimator, Target, build_estimator, check_backend,
                                     check_model, default_model, detect_backend, export_name, load_exported, load_target,
                                     register_backend, resolve_backend)

__all__ = ["BACKENDS", "Backend", "Estimator", "Target", "build_estimator", "check_backend", "check_model",
           "default_model", "detect_backend", "export_name", "load_exported", "load_target", "register_backend", "resolve_backend"]
