"""Stable Diffusion 3.5 (large, large turbo, medium, and the tiny model of its architecture) as a
model family (family.py), with its graphs (graphs.py), data flow (flow.py), levels (recipe.py) and
architectures (sizes.py)."""

from .family import SD3

__all__ = ["SD3"]
