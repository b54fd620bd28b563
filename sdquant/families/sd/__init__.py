"""Stable Diffusion 1.5 / 2.x and SDXL, the UNet families, as model families (family.py), with their
graphs (graphs.py), data flows (flow.py), levels (recipe.py), architectures (sizes.py), DeepCache
(deep_cache.py) and SDXL's scene model (scene.py)."""

from .family import SD, SDXL

__all__ = ["SD", "SDXL"]
