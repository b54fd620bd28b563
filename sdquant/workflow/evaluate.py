"""evaluate.py: each variant's images and teacher-forced noise predictions against the fp16 UNet's,
from identical initial latents."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from omegaconf import OmegaConf

import torch

from .. import build, quality, report
from ..families import family_of
from ..export import check_graph_file
from ..cli import stage
from ..config import validate_evaluate
from ..errors import UserError
from ..load import compute_dtype, empty_backbone, load_pipeline, resolve_device
from ..progress import Progress
from ..report import library_versions, print_summary
from ..stages import OnnxRuntimeStage, StageTimer
from .common import (check_cache, checked_checkpoint, restore_quantized_unet, sampling_parts, sampling_runs,
                     step_cache, text_to_image)


def run_evaluate(cfg) -> dict:
    """evaluate.py: each variant's images and teacher-forced noise predictions against the fp16 UNet's."""
    start = time.perf_counter()
    validate_evaluate(cfg)
    kinds = {name: _variant_kind(cfg.model, name, source) for name, source in cfg.variants.items()}
    parts = sampling_parts(cfg)
    caches = {}
    for name, kind in kinds.items():
        key = f"variant_cache.{name}" if name in cfg.variant_cache else "sampling.cache"
        block = OmegaConf.select(cfg, key)
        check_cache(block, key, cfg.model, parts, on_modules=kind in ("fp16", "checkpoint"))
        caches[name] = step_cache(block)
    # The reference is the uncached fp16 backbone whatever the variants cache.
    runs = [dataclasses.replace(settings, cache=None) for settings in sampling_runs(cfg)]
    device = resolve_device(cfg.device)
    family = family_of(cfg.model.family)
    dtype = compute_dtype(device, cfg.dtype, family.gpu_dtype)
    with stage("loading the model"):
        pipe = load_pipeline(cfg.model, device, dtype)
        pipeline = text_to_image(cfg, parts, family.torch_stages(pipe, dtype), device)
        lpips, clip = (quality.lpips_metric(cfg.metrics.lpips_net, device),
                       quality.clip_metric(cfg.metrics.clip_model, device))
    fp16_backbone = pipeline.stages[family.backbone_graph]
    with stage("the fp16 reference runs"):
        references = _reference_runs(pipeline, runs, device)
    reference_clip = ([value for settings, _, images, _ in references
                       for value in clip.score(None, images, settings.image_prompts)] if clip.score else None)
    reference_adherence = [row for settings, _, images, _ in references
                           for row in quality.adherence(images, settings.image_prompts)]
    columns = [torch.cat([images for _, _, images, _ in references])]
    scores = {}
    for name, kind in kinds.items():
        with stage(f"the runs of variant {name}"):
            backbone, module = _variant_backbone(cfg, name, kind, fp16_backbone, getattr(pipe, family.backbone),
                                                 device, dtype)
            if caches[name] is not None:
                pipeline.stages.update(family.cache_stages(module, dtype, caches[name]))
            scores[name], images = _variant_runs(cfg, pipeline, name, backbone, caches[name], references,
                                                 [lpips, clip], device)
        columns.append(images)
    settings = {"model": cfg.model.name, "sampling": OmegaConf.to_container(cfg.sampling, resolve=True),
                "device": report.device_name(device), "dtype": str(dtype), "versions": library_versions()}
    result = quality.build_report(scores, reference_clip, reference_adherence,
                                  [m.note for m in (lpips, clip) if m.note], settings)
    with stage("writing the report"):
        written = quality.write_outputs(Path(cfg.out_path).expanduser(), result, quality.image_grid(columns))
    quality.print_means(result)
    print_summary("quality evaluation", written, time.perf_counter() - start)
    return result


def _reference_runs(pipeline, runs: list, device: torch.device) -> list[tuple]:
    """Per pipeline call: its settings, initial latents, the fp16 backbone's images and its recorded
    calls."""
    fp16_backbone = pipeline.stages[pipeline.backbone]
    references = []
    for settings in Progress(runs, quality.REFERENCE, "prompt batches"):
        latents = pipeline.initial_latents(settings)
        recorder = quality.RecordingStage(fp16_backbone)
        pipeline.stages[pipeline.backbone] = recorder
        references.append((settings, latents, pipeline(settings, StageTimer(device), latents=latents),
                           recorder.calls))
    pipeline.stages[pipeline.backbone] = fp16_backbone
    return references


def _variant_runs(cfg, pipeline, name: str, backbone, cache, references: list[tuple], metrics: list,
                  device: torch.device) -> tuple[quality.VariantScores, torch.Tensor]:
    """One variant's scores, from the reference runs' initial latents, and its images; with a step
    cache (whose stages the pipeline holds), teacher forcing runs the cached passes too."""
    pipeline.stages[pipeline.backbone] = backbone
    source = str(cfg.variants[name] or "the fp16 backbone again (self-check)")
    variant = quality.VariantScores(source=source if cache is None else f"{source}, cached ({cache.describe()})")
    images_per_batch = []
    for settings, latents, reference, calls in Progress(references, name, "prompt batches"):
        settings = dataclasses.replace(settings, cache=cache)
        images = pipeline(settings, StageTimer(device), latents=latents)
        variant.per_prompt += quality.score_images(reference, images, settings.image_prompts, metrics)
        variant.step_errors.append(quality.teacher_forced_errors(
            calls, lambda step, inputs: pipeline.predict(settings, step, inputs, StageTimer(device))))
        variant.adherence += quality.adherence(images, settings.image_prompts)
        images_per_batch.append(images)
    return variant, torch.cat(images_per_batch)


ENGINE_SUFFIXES = (".plan", ".engine")


def _variant_kind(model, name: str, source: str | None) -> str:
    """What a variant's source is: the fp16 UNet itself, a quantize.py checkpoint, an ONNX file
    or an engine; refuses anything else, and checkpoints or graphs that are cut short or were made
    from another model, before any work starts."""
    if source is None:
        return "fp16"
    path = Path(source).expanduser()
    if not path.exists():
        raise UserError(f"variants.{name}={source}: no such file or folder")
    if path.is_dir() or path.suffix == ".mto":
        checked_checkpoint(model, f"variants.{name}", source)
        return "checkpoint"
    if path.suffix == ".onnx":
        family = family_of(model.family)
        check_graph_file(path, f"variants.{name}", family.network(family.backbone_graph))
        return "onnx"
    if path.suffix in ENGINE_SUFFIXES:
        return "engine"
    raise UserError(f"variants.{name}={source} is not a quantize.py checkpoint folder, a backbone .onnx file "
                    f"or a TensorRT engine ({', '.join(ENGINE_SUFFIXES)})")


def _variant_backbone(cfg, name: str, kind: str, fp16_backbone, fp16_module, device: torch.device,
                      dtype: torch.dtype):
    """The backbone stage a variant runs, and its module where it runs one (for a step cache)."""
    source = cfg.variants[name]
    family = family_of(cfg.model.family)
    if kind == "fp16":
        return fp16_backbone, fp16_module
    if kind == "onnx":
        return OnnxRuntimeStage(Path(source).expanduser(), list(cfg.onnx_providers), f"variants.{name}",
                                family.network(family.backbone_graph)), None
    if kind == "engine":
        from ..trt_stages import trt_stages

        plan = Path(source).expanduser()
        return trt_stages(build.engine_flavour(plan), {family.backbone_graph: plan}, ())[family.backbone_graph], None
    backbone = empty_backbone(cfg.model)
    restore_quantized_unet(cfg.model, f"variants.{name}", source, backbone)
    backbone.to(device=device, dtype=dtype)
    return family.backbone_stage(backbone, dtype), backbone
