"""Model families, each one home: what its pipeline is made of (networks with their axes, sample
inputs and engine profiles; tokenizers; the backbones the 8 bits go into), its recipe levels, its
text-to-image data flow, its architectures and its scene-training loss. The stages and scripts ask
`family_of(model.family)` and never test a family's name.

Adding a family is one module here with a `ModelFamily` subclass, its name in `config.Family` and in
`_registry` below, and a model config in conf/model/ (README: "Adding a model family").
"""

from __future__ import annotations

from functools import cache

from .base import ModelFamily
from ..config import Family


@cache
def _registry() -> dict[Family, ModelFamily]:
    from .flux import FLUX
    from .sd import SD
    from .sd3 import SD3
    from .sd import SDXL
    from .wan import WAN, WAN_TI2V

    return {Family.sdxl: SDXL, Family.sd15: SD, Family.sd2: SD, Family.flux: FLUX, Family.sd3: SD3,
            Family.wan: WAN, Family.wan_ti2v: WAN_TI2V}


def family_of(family) -> ModelFamily:
    """The description of the family that config value `family` (model.family) names."""
    return _registry()[Family(family)]


def all_families() -> list[ModelFamily]:
    return list(dict.fromkeys(_registry().values()))

