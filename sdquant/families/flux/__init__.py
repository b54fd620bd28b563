"""Flux.1 (dev, schnell, and the tiny and scene models of its architecture) as a model family
(family.py), with its graphs (graphs.py), data flow (flow.py), levels (recipe.py), architectures
(sizes.py) and scene model (scene.py)."""

from .family import FLUX

__all__ = ["FLUX"]
