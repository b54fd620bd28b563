"""Model families, each in one module: what its pipeline is made of (networks and their graphs,
tokenizers, the backbone the 8 bits go into), its recipe levels, its text-to-image data flow and
its tiny model. The stages and scripts ask `family_of(model.family)` and never test a family's name.

Adding a family (SD3.5, Qwen-Image, ...) is one more module here with a `ModelFamily` subclass,
registered in `_registry`, and its name in `sdquant.networks.Family`.
"""

from __future__ import annotations

from functools import cache

from ..networks import Family
from .base import ModelFamily
from .flux import FLUX
from .stable_diffusion import SD, SDXL


@cache
def _registry() -> dict[Family, ModelFamily]:
    return {Family.sdxl: SDXL, Family.sd15: SD, Family.sd2: SD, Family.flux: FLUX}


def family_of(family) -> ModelFamily:
    """The description of the family that config value `family` (model.family) names."""
    return _registry()[Family(family)]


def all_families() -> list[ModelFamily]:
    return list(dict.fromkeys(_registry().values()))


def dynamic_axes(graph: str, tensor: str) -> dict[int, str]:
    """{axis: label} of the dynamic axes of input or output `tensor` of the graph named `graph`."""
    for family in all_families():
        for network in (*family.networks(), *family.cache_networks()):
            if network.name == graph:
                return network.dynamic_axes.get(tensor, {})
    return {}


def sized(graph: str, tensor: str, shape, sizes: dict[str, int]) -> tuple:
    """`shape` with each dynamic axis of `tensor` set to the size `sizes` gives its label."""
    shape = list(shape)
    for axis, label in dynamic_axes(graph, tensor).items():
        if axis < len(shape):
            shape[axis] = sizes[label]
    return tuple(shape)
