"""Wan2.2 text-to-video: the two-expert T2V-A14B (`wan`) and the one-transformer TI2V-5B (`wan_ti2v`)
families, their graphs (graphs.py) and data flow (flow.py)."""

from .family import WAN, WAN_TI2V

__all__ = ["WAN", "WAN_TI2V"]
