"""The registry of model families, each one package here: what its pipeline is made of (networks with
their axes, sample inputs and engine profiles; tokenizers; the backbones the 8 bits go into), its
recipe levels, its text-to-image data flow, its architectures and its scene model. The stages and
scripts ask `family_of(model.family)` and never test a family's name.

Adding a family is one package here with a `ModelFamily` subclass, its names in `_registry` below,
and a model config in conf/model/ (docs/architecture.md: "Adding a model family").
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


def scene_configs() -> dict[str, str]:
    """The training config (tools/train_scene_model.py --config-name) of each family that has a
    scene model, by the family's name."""
    return {name: family.scene_app.config_name for name, family in _registry().items() if family.scene_app}


def scene_schemas() -> dict[str, type]:
    """Each family's scene-training schema by the name its config's defaults list starts with
    (<its config>_schema), for config.register_schemas."""
    return {f"{family.scene_app.config_name}_schema": family.scene_app for family in all_families()
            if family.scene_app is not None}


def scene_family(app) -> ModelFamily:
    """The family whose scene model the settled training config `app` trains, refusing in one line a
    family other than its schema's (whose architecture the config holds) and sizes that family's
    architecture cannot be built with."""
    # The schema's own default: the family whose architecture it holds.
    schema_family = type(app).family
    if app.family != schema_family:
        configs = scene_configs()
        own = (f"--config-name {configs[app.family]}" if app.family in configs
               else f"a family with a scene model ({', '.join(configs)})")
        raise UserError(f"family={app.family}: this config trains a {schema_family} scene model, whose "
                        f"architecture it holds: use {own}")
    app.check()
    return family_of(app.family)
