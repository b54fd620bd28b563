"""What several scripts' flows share: a quantize.py checkpoint restored into a UNet, and the prompts,
sampling settings and text-to-image pipeline of infer_trt.py and evaluate.py."""

from __future__ import annotations

from pathlib import Path

import torch

from .. import checkpoint, load, lora
from ..families import family_of
from ..families.base import vae_scale_factor
from ..config import plain, validate_image_size, validate_steps
from ..errors import UserError
from ..pipeline import SamplingSettings, make_scheduler


def checked_checkpoint(model, key: str, value: str) -> dict:
    """Refuses, before any work, a quantize.py checkpoint that config `key` names if it is missing,
    truncated, or made from another model or other LoRA adapters; returns its sidecar."""
    path = Path(value).expanduser()
    sidecar = checkpoint.check_readable(path, key)
    made_for = sidecar.get("settings", {}).get("model", {}).get("family")
    if made_for is not None and made_for != plain(model.family):
        raise UserError(f"{key}={path} was made from a {made_for} model, not from "
                        f"model={model.name} ({plain(model.family)}): choose its own model")
    if "percentile_layers" not in sidecar.get("settings", {}).get("quantize", {}):
        raise UserError(f"{key}={path} was calibrated by an sdquant older than NeMo's recipe (Percentile Quant "
                        "then covered every activation quantizer, and its means divided by the runs): quantize "
                        "again (quantize.percentile_layers=all quantize.mean_divisor=runs reproduces the old recipe)")
    made_with = sidecar.get("settings", {}).get("model", {}).get("loras", [])
    named = lora.identities(model.loras)
    if made_with != named:
        raise UserError(f"{key}={path} was calibrated with {lora.describe(made_with)}, but model.loras gives "
                        f"{lora.describe(named)}: set model.loras as the checkpoint was made, or quantize again")
    return sidecar


def restore_quantized_unet(model, key: str, value: str, unet) -> dict:
    """Loads the quantize.py checkpoint that config `key` names into `unet`; returns its sidecar."""
    sidecar = checked_checkpoint(model, key, value)
    restored = checkpoint.restore(unet, Path(value).expanduser())
    if any(t.is_meta for t in (*restored.parameters(), *restored.buffers())):
        raise UserError(f"{key}={value} does not hold every UNet weight: quantize the model again")
    return sidecar


def sampling_runs(cfg) -> list[SamplingSettings]:
    """One pipeline call per batch of sampling.batch_size prompts, each prompt's images
    sampling.num_images_per_prompt; the run's k-th image, counted over all calls, seeded seed + k."""
    sampling = cfg.sampling
    batches = _prompt_batches(sampling, cfg.model)
    per_batch = sampling.batch_size * sampling.num_images_per_prompt
    return [SamplingSettings(prompts=prompts, negative_prompt=sampling.negative_prompt, steps=sampling.steps,
                             guidance_scale=sampling.guidance_scale, height=sampling.height, width=sampling.width,
                             seed=sampling.seed + index * per_batch, images_per_prompt=sampling.num_images_per_prompt,
                             long_prompts=sampling.long_prompts, cache=step_cache(sampling.cache))
            for index, prompts in enumerate(batches)]


def step_cache(block):
    """sampling.cache as the pipelines take it: None for none."""
    from ..deep_cache import DeepCache
    from ..transformer_cache import HookCache

    if block.method == "none":
        return None
    if block.method == "deepcache":
        return DeepCache(block.interval, block.branch)
    return HookCache(block.method, block.interval, block.threshold)


def check_cache(block, key: str, model, parts: dict, runs_on: str, cuda_graph: bool = False) -> None:
    """Refuses, before any work, a step cache (config `key`) the model's backbone cannot take, or
    that what it would run on cannot: `runs_on` is "modules" (the diffusers modules), "graphs"
    (infer_trt.py's engines or ONNX files) or "one file" (an evaluate.py variant's graph or engine)."""
    if block.method == "none":
        return
    family = family_of(model.family)
    if block.method not in family.cache_methods:
        raise UserError(f"{key}.method={block.method}: model={model.name}'s {family.backbone} takes "
                        f"{' or '.join(family.cache_methods)}")
    cache = step_cache(block)
    if runs_on == "one file":
        raise UserError(f"{key}.method={block.method} runs on the diffusers modules in evaluate.py (the fp16 "
                        "backbone or a quantize.py checkpoint): a graph or engine variant is one file, and a cached "
                        "UNet runs two (infer_trt.py runs the cached graphs and engines)")
    if runs_on == "graphs" and not cache.exported:
        raise UserError(f"{key}.method={block.method} is a diffusers hook on the transformer module: run it with "
                        "backend=torch")
    if cuda_graph and not cache.exported:
        raise UserError(f"{key}.method={block.method} decides on the host at each step which blocks run, which "
                        "one captured CUDA graph cannot replay: set cuda_graph=false")
    cache.check(parts["backbone_config"], key)


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


def sampling_parts(cfg) -> dict:
    """What sampling needs of the model besides its networks (load.pipeline_parts), with
    sampling's image size and steps settled against the model before any work."""
    parts = load.pipeline_parts(cfg.model)
    cfg.sampling.height, cfg.sampling.width = settled_image_size(cfg.sampling, "sampling", cfg.model, parts)
    # Settled here so that reports name the scheduler that ran, not a null.
    cfg.sampling.scheduler = cfg.sampling.scheduler or family_of(cfg.model.family).default_scheduler()
    validate_steps(cfg.sampling.steps, "sampling.steps", parts["scheduler_config"])
    runs_on = "modules" if cfg.get("backend", "torch") == "torch" else "graphs"
    check_cache(cfg.sampling.cache, "sampling.cache", cfg.model, parts, runs_on, cfg.get("cuda_graph", False))
    return parts


def settled_image_size(block, prefix: str, model, configs: dict | None = None) -> tuple[int, int]:
    """The (height, width) that `block` asks for, a null one taking the model's native size as
    diffusers does; refuses, before any work, a size the model's VAE cannot make, and says the
    size used. `configs`: the model's configs where the caller has them already."""
    configs = load.model_configs(model) if configs is None else configs
    asked = {key: block[key] for key in ("height", "width")}
    if not configs:
        if None in asked.values():
            raise UserError(f"{prefix}.height and {prefix}.width: model.source={model.source} is a single file, which "
                            "does not state the model's native size: set both (1024 for SDXL, 512 for SD 1.5), or "
                            "set model.single_file_config")
        validate_image_size(block, prefix)
        return asked["height"], asked["width"]
    family = family_of(model.family)
    vae_scale = vae_scale_factor(configs["vae_config"])
    native = family.native_image_size(configs, vae_scale)
    size = {key: native if value is None else value for key, value in asked.items()}
    validate_image_size(size, prefix, family.size_multiple(vae_scale), family.size_reason)
    note = " (the model's native size)" if None in asked.values() else ""
    print(f"image size: {size['width']}x{size['height']}{note}", flush=True)
    return size["height"], size["width"]


def text_to_image(cfg, parts: dict, stages: dict, device: torch.device):
    """The family's denoising loop over `stages`, with the model's tokenizers and scheduler config
    (`parts`)."""
    scheduler = make_scheduler(cfg.sampling.scheduler, parts["scheduler_config"])
    return family_of(cfg.model.family).text_to_image(stages, parts, scheduler, device)
