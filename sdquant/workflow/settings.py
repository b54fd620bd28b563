"""The scripts' configs settled once, at their start, into what the stages take: the model's family
and parts, the sample geometry (frames, height, width), the scheduler, the step cache and the
prompt batches of infer_trt.py and evaluate.py, quantize.py's calibration and export_trt.py's
export, and a quantize.py checkpoint checked and restored into the backbones. Every settled value is
a new read-only object: nothing below the scripts' workflow reads the raw config or changes it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from ..quantize import checkpoint
from .. import load, lora
from ..config import plain, validate_image_size, validate_steps
from ..errors import UserError
from ..families import family_of
from ..families.base import ModelFamily
from ..families.pipeline import SamplingSettings, make_scheduler
from ..graphs.geometry import SampleGeometry


def frozen(block, **settled):
    """A read-only copy of config block `block` with the `settled` values put in."""
    copy = OmegaConf.merge(block, settled)
    OmegaConf.set_readonly(copy, True)
    return copy


def checked_checkpoint(model, key: str, value: str) -> dict:
    """Refuses, before any work, a quantize.py checkpoint that config `key` names if it is missing,
    truncated, without one of the model's backbones, or made from another model or other LoRA
    adapters; returns its record."""
    family = family_of(model.family)
    path = Path(value).expanduser()
    record = checkpoint.read_record(path, key, family.backbone_attributes)
    made_for = record.get("settings", {}).get("model", {}).get("family")
    if made_for is not None and made_for != plain(model.family):
        raise UserError(f"{key}={path} was made from a {made_for} model, not from "
                        f"model={model.name} ({plain(model.family)}): choose its own model")
    checkpoint.check_backbone_files(path, key, family.backbone_attributes)
    made_with = record.get("settings", {}).get("model", {}).get("loras", [])
    named = lora.identities(model.loras)
    if made_with != named:
        raise UserError(f"{key}={path} was calibrated with {lora.describe(made_with)}, but model.loras gives "
                        f"{lora.describe(named)}: set model.loras as the checkpoint was made, or quantize again")
    return record


def restore_quantized_backbones(model, key: str, value: str, backbones: dict) -> dict:
    """Loads the quantize.py checkpoint that config `key` names into `backbones` (the modules, by
    attribute); returns its record."""
    family = family_of(model.family)
    record = checked_checkpoint(model, key, value)
    folder = checkpoint.checkpoint_folder(Path(value).expanduser(), key, family.backbone_attributes)
    for attribute, backbone in backbones.items():
        restored = checkpoint.restore(backbone, folder, attribute)
        if any(t.is_meta for t in (*restored.parameters(), *restored.buffers())):
            raise UserError(f"{key}={value} does not hold every weight of the {attribute}: quantize the model again")
    return record


def settled_geometry(block, prefix: str, model, configs: dict | None = None) -> SampleGeometry:
    """The geometry `block` asks for (its height, width and, where it has one, num_frames), a null
    value taking the model's own as diffusers does; refuses, before any work, a size or a frame count
    the model cannot make, and says the size used. `configs`: the model's configs where the caller
    has them already."""
    family = family_of(model.family)
    configs = load.model_configs(model) if configs is None else configs
    frames = family.settled_frames(block.get("num_frames"), f"{prefix}.num_frames", model)
    asked = {key: block[key] for key in ("height", "width")}
    if not configs:
        if None in asked.values():
            raise UserError(f"{prefix}.height and {prefix}.width: model.source={model.source} is a single file, which "
                            "does not state the model's native size: set both (1024 for SDXL, 512 for SD 1.5), or "
                            "set model.single_file_config")
        validate_image_size(block, prefix)
        return SampleGeometry(frames, asked["height"], asked["width"])
    vae_scale = family.vae_scale(configs["vae_config"])
    native = dict(zip(("height", "width"), family.native_size(model, configs, vae_scale)))
    size = {key: native[key] if value is None else value for key, value in asked.items()}
    validate_image_size(size, prefix, family.size_multiple(vae_scale), family.size_reason)
    geometry = SampleGeometry(frames, size["height"], size["width"])
    note = " (the model's native size)" if None in asked.values() else ""
    print(f"{'video' if frames > 1 else 'image'} size: {geometry.describe()}{note}", flush=True)
    return geometry


@dataclass(frozen=True)
class Sampling:
    """sampling.* settled against the model: its family and parts (tokenizers, configs), the block
    with the geometry and scheduler filled in (read-only), the step cache and one SamplingSettings
    per pipeline call."""

    family: ModelFamily
    parts: dict
    block: object
    geometry: SampleGeometry
    cache: object | None
    runs: list[SamplingSettings]

    def pipeline(self, stages: dict, device: torch.device):
        """The family's denoising loop over `stages`, with the model's tokenizers and scheduler."""
        scheduler = make_scheduler(self.block.scheduler, self.parts["scheduler_config"])
        return self.family.text_to_image(stages, self.parts, scheduler, device)


def settled_guidance(block, key: str, model) -> dict:
    """Config block `key`'s guidance_scale and guidance_scale_2, each null one the model's own
    (model.guidance_scale, model.guidance_scale_2); a second scale refused for a model of one
    backbone. The second stays null where both are, which the pipelines read as the first's."""
    family = family_of(model.family)
    family.check_guidance(block.guidance_scale_2, f"{key}.guidance_scale_2")
    family.check_guidance(model.guidance_scale_2, "model.guidance_scale_2")
    return {"guidance_scale": model.guidance_scale if block.guidance_scale is None else block.guidance_scale,
            "guidance_scale_2": model.guidance_scale_2 if block.guidance_scale_2 is None else block.guidance_scale_2}


def settle_sampling(cfg, runs_on: str = "modules", cuda_graph: bool = False) -> Sampling:
    """sampling.* and model.* as the pipelines take them, every value checked against the model
    before any work: the geometry (a null size the model's native one), the scheduler (a null one
    the family's), the steps, the guidance (a null one the model's), the step cache for what it
    `runs_on` (check_cache), the prompt batches."""
    family = family_of(cfg.model.family)
    parts = load.pipeline_parts(cfg.model)
    geometry = settled_geometry(cfg.sampling, "sampling", cfg.model, parts)
    guidance = settled_guidance(cfg.sampling, "sampling", cfg.model)
    block = frozen(cfg.sampling, **guidance, height=geometry.height, width=geometry.width,
                   num_frames=geometry.frames, fps=family.settled_fps(cfg.sampling.fps, "sampling.fps", cfg.model),
                   scheduler=cfg.sampling.scheduler or family.default_scheduler)
    validate_steps(block.steps, "sampling.steps", parts["scheduler_config"])
    cache = checked_cache(block.cache, "sampling.cache", cfg.model, parts, runs_on, cuda_graph)
    runs = sampling_runs(block, cfg.model, cache)
    if block.long_prompts == "error":
        family.text_to_image({}, parts, None, torch.device("cpu")).refuse_cut_prompts(runs)
    return Sampling(family, parts, block, geometry, cache, runs)


def sampling_runs(sampling, model, cache=None) -> list[SamplingSettings]:
    """One pipeline call per batch of sampling.batch_size prompts, each prompt's images (or videos)
    sampling.num_images_per_prompt; the run's k-th sample, counted over all calls, seeded seed + k.
    `sampling`: a settled block (its size and frames filled in)."""
    batches = _prompt_batches(sampling, model)
    per_batch = sampling.batch_size * sampling.num_images_per_prompt
    return [SamplingSettings(prompts=prompts, negative_prompt=sampling.negative_prompt, steps=sampling.steps,
                             guidance_scale=sampling.guidance_scale, height=sampling.height, width=sampling.width,
                             seed=sampling.seed + index * per_batch, images_per_prompt=sampling.num_images_per_prompt,
                             long_prompts=sampling.long_prompts, cache=cache, frames=sampling.num_frames or 1,
                             guidance_scale_2=sampling.guidance_scale_2, fps=sampling.fps)
            for index, prompts in enumerate(batches)]


def checked_cache(block, key: str, model, parts: dict, runs_on: str, cuda_graph: bool = False):
    """The step cache config `key` asks for (None for none), refused before any work where the
    model's backbone cannot take it, or what it would run on cannot: `runs_on` is "modules" (the
    diffusers modules), "graphs" (infer_trt.py's engines or ONNX files) or "one file" (an
    evaluate.py variant's graph or engine)."""
    family = family_of(model.family)
    if block.method not in family.cache_methods:
        takes = "takes" if len(family.backbones) == 1 else "take"
        raise UserError(f"{key}.method={block.method}: model={model.name}'s {' and '.join(family.backbone_attributes)} "
                        f"{takes} {' or '.join(family.cache_methods)}")
    cache = family.step_cache(block)
    if cache is None:
        return None
    if runs_on == "one file":
        raise UserError(f"{key}.method={block.method} runs on the diffusers modules in evaluate.py (the unquantized "
                        "backbone or a quantize.py checkpoint): a graph or engine variant is one file, and a cached "
                        "backbone runs two (infer_trt.py runs the cached graphs and engines)")
    if runs_on == "graphs" and not cache.exported:
        raise UserError(f"{key}.method={block.method} is a diffusers hook on the transformer module: run it with "
                        "backend=torch")
    if cuda_graph and not cache.exported:
        raise UserError(f"{key}.method={block.method} decides on the host at each step which blocks run, which "
                        "one captured CUDA graph cannot replay: set cuda_graph=false")
    cache.check(parts["backbone_config"], key)
    return cache


def _prompt_batches(sampling, model) -> list[list[str]]:
    """sampling.prompts_file's prompts, else sampling.prompts, else the model's evaluation prompts,
    in batches of sampling.batch_size."""
    if sampling.prompts_file or sampling.prompts is None:
        key, value = ("sampling.prompts_file", sampling.prompts_file) if sampling.prompts_file else \
            ("model.eval_prompts", model.eval_prompts or load.builtin_prompts_path("eval_prompts.txt"))
        path = Path(value).expanduser()
        if not path.is_file():
            raise UserError(f"{key}={path}: no such file")
        prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    else:
        prompts = list(sampling.prompts)
    if not prompts:
        raise UserError("no prompts: set sampling.prompts or sampling.prompts_file")
    return [prompts[i:i + sampling.batch_size] for i in range(0, len(prompts), sampling.batch_size)]
