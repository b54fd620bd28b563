"""Wan2.2 text-to-video: the two-expert T2V-A14B (`wan`) and the one-transformer TI2V-5B (`wan_ti2v`)
as model families (family.py), with their graphs (graphs.py), data flow (flow.py), levels
(recipe.py), architectures (sizes.py) and the A14B's scene model (scene.py)."""

from .family import WAN, WAN_TI2V

__all__ = ["WAN", "WAN_TI2V"]
