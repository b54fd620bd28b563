"""What one pipeline call draws, settled against the model: the one place that checks a call's
prompts, steps, size or frames, guidance and step cache, for a script's prompt batches, the Python
API's calls and a server's requests alike."""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import load
from ..config import CACHE_METHODS, LONG_PROMPTS, CacheBlock, SamplingBlock, validate_steps
from ..errors import UserError
from ..families.pipeline import SamplingSettings
from ..runtime.cache_hooks import TAYLORSEER_METHODS
from .model import Model

# A call's settings as a caller names them (sampling.<name> in the scripts' configs), with what a
# null or absent one takes.
CALL_DEFAULTS = {"negative_prompt": "", "steps": SamplingBlock.steps, "guidance_scale": None,
                 "guidance_scale_2": None, "height": None, "width": None, "num_frames": None, "fps": None,
                 "seed": SamplingBlock.seed, "num_images_per_prompt": 1, "long_prompts": "truncate", "cache": None}


def settle_call(model: Model, prompts: list[str], prefix: str = "", **asked) -> SamplingSettings:
    """One pipeline call of `prompts`, each value of `asked` (CALL_DEFAULTS' names; an absent or
    null one the model's own) checked against the model before any work; `prefix` names the values
    in messages as the caller does ("sampling." in the scripts). `cache`: a CacheBlock, or None for
    none."""
    unknown = sorted(set(asked) - set(CALL_DEFAULTS))
    if unknown:
        raise UserError(f"{prefix}{unknown[0]} is no setting of a call: give {', '.join(CALL_DEFAULTS)}")
    values = {**CALL_DEFAULTS, **{key: value for key, value in asked.items() if value is not None}}
    _check_values(values, prefix)
    if isinstance(prompts, str) or not prompts or not all(isinstance(prompt, str) for prompt in prompts):
        raise UserError(f"{prefix}prompts={prompts!r}: give a list of one or more prompts")
    family = model.family
    sample = family.settle_sample(model.config, model.parts, prefix, values["height"], values["width"],
                                  values["num_frames"], values["fps"], values["guidance_scale"],
                                  values["guidance_scale_2"])
    if "scheduler_config" in model.parts:
        validate_steps(values["steps"], f"{prefix}steps", model.parts["scheduler_config"])
    cache = settle_cache(model, cache_block(values["cache"], f"{prefix}cache"), f"{prefix}cache")
    geometry = sample.geometry
    settings = SamplingSettings(prompts=list(prompts), negative_prompt=values["negative_prompt"], steps=values["steps"],
                            guidance_scale=sample.guidance_scale, height=geometry.height, width=geometry.width,
                            seed=values["seed"], images_per_prompt=values["num_images_per_prompt"],
                            long_prompts=values["long_prompts"], cache=cache, frames=geometry.frames, fps=sample.fps,
                            guidance_scale_2=sample.guidance_scale_2)
    if settings.long_prompts == "error":
        family.text_to_image({}, model.parts, None, torch.device("cpu")).refuse_cut_prompts([settings])
    return settings


def _check_values(values: dict, prefix: str) -> None:
    """The values alone, before the model is asked: their types, counts positive, scales finite,
    names known (a None is the model's own, checked by its family)."""
    for key in ("steps", "num_images_per_prompt"):
        if not _number(values[key], int) or values[key] < 1:
            raise UserError(f"{prefix}{key}={values[key]!r} must be a whole number, at least 1")
    for key in ("height", "width", "num_frames", "fps"):
        if values[key] is not None and not _number(values[key], int):
            raise UserError(f"{prefix}{key}={values[key]!r} must be a whole number")
    if not _number(values["seed"], int) or not 0 <= values["seed"] < 2**63:
        raise UserError(f"{prefix}seed={values['seed']!r} must be a whole number from 0 to 2**63 - 1")
    for key in ("guidance_scale", "guidance_scale_2"):
        scale = values[key]
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not math.isfinite(scale) or scale < 0):
            raise UserError(f"{prefix}{key}={scale!r} must be a number, 0 or more")
    if values["long_prompts"] not in LONG_PROMPTS:
        raise UserError(f"{prefix}long_prompts={values['long_prompts']!r} is unknown: choose "
                        f"{' or '.join(LONG_PROMPTS)}")
    if not isinstance(values["negative_prompt"], str):
        raise UserError(f"{prefix}negative_prompt={values['negative_prompt']!r} must be text")


def cache_block(asked, key: str) -> CacheBlock:
    """A call's step cache as a CacheBlock: given as one, as a dict of its keys, or None (none)."""
    if asked is None or isinstance(asked, CacheBlock):
        return asked or CacheBlock()
    known = {field.name for field in dataclasses.fields(CacheBlock)}
    if not isinstance(asked, dict) or set(asked) - known:
        raise UserError(f"{key}={asked!r}: give a dict of {', '.join(sorted(known))} (sampling.cache's keys)")
    defaults, hints = CacheBlock(), typing.get_type_hints(CacheBlock)
    for name, value in asked.items():
        kind = type(getattr(defaults, name))
        if kind is dict:
            if not isinstance(value, dict) or not all(isinstance(k, str) and _of_kind(v, typing.get_args(hints[name])[1])
                                                      for k, v in value.items()):
                raise UserError(f"{key}.{name}={value!r} must be a dict of backbone names to "
                                f"{_says(typing.get_args(hints[name])[1])}")
        elif not _number(value, kind):
            raise UserError(f"{key}.{name}={value!r} must be {'a number' if kind is float else kind.__name__}")
    return CacheBlock(**asked)


def _of_kind(value, kind) -> bool:
    """Whether a value is of that kind: a number, or a list of numbers (list[int])."""
    if typing.get_origin(kind) is list:
        return isinstance(value, (list, tuple)) and all(_number(item, typing.get_args(kind)[0]) for item in value)
    return _number(value, kind)


def _says(kind) -> str:
    if typing.get_origin(kind) is list:
        return f"lists of {_says(typing.get_args(kind)[0])}"
    return "whole numbers" if kind is int else "numbers"


def _number(value, kind: type) -> bool:
    """Whether a value is of that kind (a float may be given as an int), not a bool."""
    return isinstance(value, (int, float) if kind is float else kind) and not isinstance(value, bool)


def settle_cache(model: Model, block: CacheBlock, key: str):
    """The step cache config `key` asks for (None for none), refused where the model's backbones
    cannot take it or its settings are out of range."""
    family = model.family
    if block.method not in CACHE_METHODS:
        raise UserError(f"{key}.method={block.method!r} is unknown: choose {' or '.join(CACHE_METHODS)}")
    if block.method not in family.cache_methods:
        takes = "takes" if len(family.backbones) == 1 else "take"
        raise UserError(f"{key}.method={block.method}: model={model.name}'s {' and '.join(family.backbone_attributes)} "
                        f"{takes} {' or '.join(family.cache_methods)}")
    check_per_backbone(model, block, key)
    if block.order != 1 and block.method not in TAYLORSEER_METHODS:
        raise UserError(f"{key}.order={block.order}: only TaylorSeer ({' and '.join(TAYLORSEER_METHODS)}) "
                        f"extrapolates, not {block.method}: leave it at 1")
    cache = family.step_cache(block)
    if cache is not None:
        cache.check(model.parts.get("backbone_config", {}), key)
    return cache


def check_per_backbone(model: Model, block: CacheBlock, key: str) -> None:
    """A per-backbone setting names backbones of the model and belongs to the method that reads it."""
    for setting, methods, takes in (
            ("backbone_intervals", TAYLORSEER_METHODS, f"only TaylorSeer ({' and '.join(TAYLORSEER_METHODS)}) takes an "
                                                       "interval"),
            ("backbone_thresholds", ("first_block",), "only first_block takes a threshold"),
            ("backbone_full_steps", ("first_block",), "only first_block takes a schedule")):
        named = getattr(block, setting)
        if not named:
            continue
        if block.method not in methods:
            raise UserError(f"{key}.{setting}: {takes} a backbone, not {block.method}: leave it empty")
        unknown = sorted(set(named) - set(model.family.backbone_attributes))
        if unknown:
            raise UserError(f"{key}.{setting}: model={model.name} has no backbone {', '.join(unknown)}: "
                            f"name {' or '.join(model.family.backbone_attributes)}")


@dataclass(frozen=True)
class Sampling:
    """sampling.* settled: one call per prompt batch (the run's k-th sample, counted over all calls,
    seeded seed + k), the scheduler, and the block as the records hold it."""

    runs: tuple[SamplingSettings, ...]
    scheduler: str
    record: dict

    @property
    def first(self) -> SamplingSettings:
        return self.runs[0]


def settle_defaults(model: Model, block: SamplingBlock) -> SamplingSettings:
    """sampling.*'s values but the prompts settled as a call's (settle_call), the defaults of the
    calls a Python API pipeline takes."""
    return settle_call(model, [""], "sampling.", **defaults_of(block))


def defaults_of(block: SamplingBlock) -> dict:
    """A sampling block's values of a call's settings (CALL_DEFAULTS' names)."""
    return {key: getattr(block, key) for key in CALL_DEFAULTS}


def settle_sampling(model: Model, block: SamplingBlock) -> Sampling:
    """sampling.* as the pipeline calls take it: each prompt batch's call settled (settle_call), the
    scheduler (a null one the family's), prompts past the text encoders refused where
    long_prompts=error; says the size where it is the model's own."""
    per_batch = block.batch_size * block.num_images_per_prompt
    values = defaults_of(block)
    runs = tuple(settle_call(model, prompts, "sampling.", **{**values, "seed": block.seed + index * per_batch})
                 for index, prompts in enumerate(prompt_batches(block, model.config)))
    first = runs[0]
    scheduler = block.scheduler or model.family.default_scheduler
    say_size(first.geometry, (block.height, block.width))
    record = {**dataclasses.asdict(block), "guidance_scale": first.guidance_scale,
              "guidance_scale_2": first.guidance_scale_2, "height": first.height, "width": first.width,
              "num_frames": first.frames, "fps": first.fps, "scheduler": scheduler}
    return Sampling(runs, scheduler, record)


def say_size(geometry, asked: tuple) -> None:
    """Says the size a run settled on, and what of it is the model's own (`asked`: the height and
    width asked for, None where not)."""
    own = [name for name, value in zip(("height", "width"), asked) if value is None]
    note = " (the model's native size)" if len(own) == 2 else f" (the model's native {own[0]})" if own else ""
    print(f"{'video' if geometry.frames > 1 else 'image'} size: {geometry.describe()}{note}", flush=True)


def prompt_batches(block: SamplingBlock, model) -> list[list[str]]:
    """sampling.prompts_file's prompts, else sampling.prompts, else the model's evaluation prompts,
    in batches of sampling.batch_size."""
    if block.batch_size < 1:
        raise UserError(f"sampling.batch_size={block.batch_size} must be at least 1")
    if block.prompts_file or block.prompts is None:
        key, value = ("sampling.prompts_file", block.prompts_file) if block.prompts_file else \
            ("model.eval_prompts", model.eval_prompts or load.builtin_prompts_path("eval_prompts.txt"))
        path = Path(value).expanduser()
        if not path.is_file():
            raise UserError(f"{key}={path}: no such file")
        prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        if not prompts:
            raise UserError(f"{key}={path} holds no prompts: give a file of one prompt a line")
    else:
        prompts = list(block.prompts)
    if not prompts:
        raise UserError("no prompts: set sampling.prompts or sampling.prompts_file")
    return [prompts[i:i + block.batch_size] for i in range(0, len(prompts), block.batch_size)]
