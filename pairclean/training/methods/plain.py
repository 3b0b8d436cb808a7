"""plain: every pair counts fully, the baseline."""

from __future__ import annotations

from dataclasses import dataclass

from pairclean.training.methods.base import Method, register_method


@dataclass
class PlainOptions:
    pass


@register_method
class Plain(Method):
    """Every pair counts fully: the baseline."""

    name = "plain"
    Options = PlainOptions
