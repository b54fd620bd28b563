"""The registry of model families, each one package here: what its pipeline is made of (networks with
their axes, sample inputs and engine profiles; tokenizers; the backbones the 8 bits go into), its
recipe levels, its text-to-image data flow, its architectures and its scene model. The stages and
scripts ask `family_of(model.family)` and never test a family's name.

Adding a family is one package here with a `ModelFamily` subclass, its names in `_registry` below,
and a model config in conf/model/ (README: "Adding a model family").
"""

from __future__ import annotations

from functools import cache

from .base import ModelFamily
from ..errors import UserError


@cache
def _registry() -> dict[str, ModelFamily]:
    """Each family by the names model.family gives it."""
    from .flux import FLUX
    from .sd import SD, SDXL
    from .sd3 import SD3
    from .wan import WAN, WAN_TI2V

    return {"sdxl": SDXL, "sd15": SD, "sd2": SD, "flux": FLUX, "sd3": SD3, "wan": WAN, "wan_ti2v": WAN_TI2V}


def family_names() -> tuple[str, ...]:
    return tuple(_registry())


def family_of(name: str) -> ModelFamily:
    """The description of the family that config value `name` (model.family) names."""
    families = _registry()
    if name not in families:
        raise UserError(f"model.family={name} is not a family sdquant knows: choose one of {', '.join(families)}")
    return families[name]


def all_families() -> list[ModelFamily]:
    return list(dict.fromkeys(_registry().values()))

