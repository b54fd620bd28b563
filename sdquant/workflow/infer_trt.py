"""infer_trt.py: images for every prompt batch on the engines (or their ONNX files, or the diffusers
modules), then warm-up and timed runs and a latency report per stage."""

from __future__ import annotations

import time
from pathlib import Path

from omegaconf import OmegaConf

import torch

from .. import build, networks, parallel, report
from ..families import family_of
from ..cli import stage
from ..config import validate_infer
from ..errors import UserError
from ..load import compute_dtype, load_pipeline, resolve_device
from ..pipeline import SamplingSettings
from ..report import library_versions, print_summary
from ..stages import OnnxRuntimeStage, StageTimer
from .common import (checked_checkpoint, restore_quantized_unet, sampling_parts, sampling_runs, step_cache,
                     text_to_image)


def run_infer(cfg) -> dict:
    """infer_trt.py: images for this process's share of the prompt batches (all of them in one
    process; under torchrun or as one of shard.count jobs, batch i on part i mod parts, with its
    global seed and file names), then timed runs and one latency report for all the parts."""
    start = time.perf_counter()
    validate_infer(cfg)
    if cfg.quantized_unet:
        sidecar = checked_checkpoint(cfg.model, "quantized_unet", cfg.quantized_unet)
        if cfg.torch_backend.quantized != "fake":
            from ..torch_backend import check_format

            check_format(cfg.quantized_unet, sidecar["settings"]["quantize"]["format"], cfg.torch_backend.quantized)
    world = parallel.current_world()
    device = parallel.rank_device(resolve_device(cfg.device), world)
    parallel.start(world, device)
    try:
        # Every stage runs on the current stream (TensorRT engines included), so one stream of the
        # run's own keeps the stages, the host's reads and the timing events in order; TensorRT
        # would synchronize extra on the legacy default stream.
        with torch.cuda.stream(torch.cuda.Stream(device) if device.type == "cuda" else None):
            written, timings, images_per_run, first_call_seconds = _images_and_timings(
                cfg, device, parallel.share_of(world, cfg.shard))
        latency = report.latency_report(timings, images_per_run, cfg.sampling.steps,
                                        family_of(cfg.model.family).backbone_graph)
        # The first call compiles (torch_backend.compile) or sets engines and graphs up: its excess
        # over a timed run is what a user waits once per process and shape.
        latency["first_call_seconds"] = first_call_seconds
        latency["setup_seconds"] = first_call_seconds - latency["ms"]["end_to_end"] / 1000
        latency.update({"backend": cfg.backend, "device": report.device_name(device),
                        "images_written": sum(path.suffix == ".png" for path in written)})
        latencies, written = parallel.gather(latency, world), sum(parallel.gather(written, world), [])
        if not world.is_main:
            return latency
        merged = latencies[0] if len(latencies) == 1 else report.merged_latency(latencies)
        merged.update({"versions": library_versions(), "settings": OmegaConf.to_container(cfg, resolve=True)})
        out = Path(cfg.out_path).expanduser()
        if cfg.shard.count > 1:
            written.append(report.write_report(out, merged, f"latency.shard{cfg.shard.index}of{cfg.shard.count}.json"))
            merged = report.merge_shard_reports(out, cfg.shard.count) or merged
        report.print_latency(merged)
        if cfg.shard.count == 1 or "shards" in merged:
            written.append(report.write_report(out, merged))
        print_summary("inference", sorted(written), time.perf_counter() - start)
        return merged
    finally:
        parallel.stop(world)


def _images_and_timings(cfg, device: torch.device, part: parallel.World) -> tuple[list[Path], list, int, float]:
    """The images of this part's prompt batches, then the warm-up and timed runs of its first
    batch; also the first call's seconds."""
    parts = sampling_parts(cfg)
    runs = sampling_runs(cfg)
    mine = parallel.shard(runs, part, "prompt batches (prompts / sampling.batch_size)")
    with stage(f"loading the {cfg.backend} stages"):
        pipeline = text_to_image(cfg, parts, load_stages(cfg, device), device)
    if cfg.backend == "trt":
        _check_engine_profiles(pipeline, [settings for _, settings in mine])

    written = []
    first_call_seconds = None
    for index, settings in mine:
        with stage(f"prompt batch {index + 1} of {len(runs)}"):
            call_start = time.perf_counter()
            images = pipeline(settings, StageTimer(device))
            first_call_seconds = first_call_seconds or time.perf_counter() - call_start
            written += report.save_images(images, Path(cfg.out_path).expanduser(), index, settings,
                                          _stage_files(cfg), cfg.backend)
    first = mine[0][1]
    with stage("the warm-up and timed runs"):
        for _ in range(cfg.num_warmup_runs):
            pipeline(first, StageTimer(device), progress=False)
        timings = []
        for _ in range(cfg.num_timed_runs):
            timer = StageTimer(device)
            run_start = time.perf_counter()
            pipeline(first, timer, progress=False)
            stage_seconds = timer.finish()
            timings.append((time.perf_counter() - run_start, stage_seconds))
    return written, timings, len(first.image_prompts), first_call_seconds


def _stage_files(cfg) -> dict[str, Path]:
    """Engine file per stage, from the config key the family names it by (NeMo's for SDXL)."""
    family = family_of(cfg.model.family)
    keys = family.engine_keys()
    files = {name: Path(cfg[keys[name]]).expanduser() for name in family.graph_names()}
    if step_cache(cfg.sampling.cache) is not None:
        # A cached backbone's passes lie beside its engine (or graph), as export_trt.py cache=... builds them.
        backbone = files[family.backbone_graph]
        files.update({network.name: backbone.with_name(f"{network.name}{backbone.suffix}")
                      for network in family.cache_networks()})
    return files


def _stage_key(family, name: str, plan: Path) -> str:
    """How an error names a stage's file: its config key, or the file for a cached pass."""
    keys = family.engine_keys()
    return keys[name] if name in keys else str(plan)


def load_stages(cfg, device: torch.device) -> dict:
    family = family_of(cfg.model.family)
    files = _stage_files(cfg)
    if cfg.backend == "onnxruntime":
        return {name: OnnxRuntimeStage(networks.onnx_path(plan.parent.parent, plan.stem), list(cfg.onnx_providers),
                                       _stage_key(family, name, plan), family.network(name))
                for name, plan in files.items()}
    if cfg.backend == "torch":
        from .. import torch_backend

        dtype = compute_dtype(device, gpu_dtype=family.gpu_dtype)
        pipe = load_pipeline(cfg.model, device, dtype)
        backbone = getattr(pipe, family.backbone)
        if cfg.quantized_unet:
            restore_quantized_unet(cfg.model, "quantized_unet", cfg.quantized_unet, backbone)
            backbone.to(device=device, dtype=dtype)
            if cfg.torch_backend.quantized != "fake":
                torch_backend.convert_quantized(backbone, cfg.quantized_unet, cfg.torch_backend.quantized)
        stages = family.torch_stages(pipe, dtype)
        cache = step_cache(cfg.sampling.cache)
        if cache is not None:
            stages.update(family.cache_stages(backbone, dtype, cache))
        return torch_backend.speed_up(pipe, family, stages, cfg.torch_backend, cfg.cuda_graph,
                                      quantized=bool(cfg.quantized_unet))
    from ..trt_stages import trt_stages

    for name, plan in files.items():
        if not plan.is_file():
            how = (f"export_trt.py cache.method={cfg.sampling.cache.method} cache.branch={cfg.sampling.cache.branch}"
                   if name in family.backbone_graphs()[1:] else "export_trt.py")
            raise UserError(f"{_stage_key(family, name, plan)}={plan}: no such engine; build it with {how}")
    flavours = {name: build.engine_flavour(plan) for name, plan in files.items()}
    return trt_stages(flavours, files, family.backbone_graphs() if cfg.cuda_graph else ())


def _check_engine_profiles(pipeline, runs: list[SamplingSettings]) -> None:
    """Refuses, before any image work, a prompt batch or size the engines' profiles cannot take."""
    from ..trt_stages import check_within_profiles

    profiles = {name: stage.profiles() for name, stage in pipeline.stages.items()}
    for settings in runs:
        check_within_profiles(profiles, pipeline.stage_batches(settings), pipeline.latent_size(settings),
                              pipeline.sequence_sizes(settings))
