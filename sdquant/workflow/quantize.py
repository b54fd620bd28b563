"""quantize.py: calibrates and quantizes the model's backbones, then exports and builds them when
NeMo's switches ask. The config is settled once (settle_quantize) into a Quantize, with the export
of its checkpoint settled beside it as export_trt.py settles its own (an Export): two settled steps,
run one after the other."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from ..quantize import checkpoint
from .. import parallel
from ..quantize.calibrate import activation_amax, amax_summary, quantize_backbones
from ..cli import stage
from ..config import validate_image_size, validate_quantize_block, validate_steps
from ..errors import UserError
from ..families import family_of
from ..families.base import ModelFamily
from ..graphs.geometry import SampleGeometry
from ..load import compute_dtype, load_pipeline, load_prompts, model_configs, resolve_device
from ..graphs.networks import TOKENS
from ..families.pipeline import say_truncated
from ..quantize.recipe import recipe_identity, uses_smoothquant
from ..report import library_versions, print_summary
from .export_trt import Export, export, settle_export
from .settings import frozen, settled_geometry, settled_guidance


@dataclass(frozen=True)
class Quantize:
    """quantize.py's config settled: the model and its family, the calibration (what makes the
    checkpoint, and its folder), the quantize block with the geometry filled in (read-only; a null
    size stays null in the calibration, as in the checkpoints made before), the prompts, the run's
    switches and the export of the checkpoint, where the switches ask for one."""

    model: object
    family: ModelFamily
    calibration: checkpoint.Calibration
    folder: Path
    block: object
    geometry: SampleGeometry | None
    prompts_file: str | None
    config: dict
    force: bool
    device: str
    dtype: str
    cuda_graph: bool
    cpu_offload: bool
    run_quantization: bool
    export: Export | None


def calibration_of(cfg, family: ModelFamily) -> checkpoint.Calibration:
    """What identifies the checkpoint `cfg` makes. The guidance is the settled one (a null scale the
    model's), so a checkpoint of a model's own guidance is the same whether asked for by value or by
    null. A video model's geometry is the one its config settles to, since a null size or frame count
    takes the model config's own, which the model's identity does not hold."""
    block = OmegaConf.to_container(cfg.quantize, resolve=True) | settled_guidance(cfg.quantize, "quantize", cfg.model)
    if family.output == "video":
        native = dict(zip(("height", "width"), family.native_size(cfg.model, {}, 0)))
        block.update({key: native[key] if block[key] is None else block[key] for key in native},
                     num_frames=family.settled_frames(cfg.quantize.num_frames, "quantize.num_frames", cfg.model))
    return checkpoint.Calibration(
        quantize=block, model=checkpoint.model_identity(cfg.model), model_name=cfg.model.name,
        prompts_file=cfg.prompts_file or cfg.model.calib_prompts, seed=cfg.seed,
        recipe=recipe_identity(family.level_table, cfg.quantize))


def quantized_checkpoint_dir(cfg) -> Path:
    """The folder the calibration `cfg` asks for is saved in."""
    return Path(cfg.out_dir).expanduser() / calibration_of(cfg, family_of(cfg.model.family)).folder_name()


def settle_quantize(cfg) -> Quantize:
    """quantize.py's config, every value checked before any work: the recipe, the geometry (from the
    model's configs where a diffusers folder states them), the steps and, where the switches ask for
    the export, the export of the checkpoint into infer.out_path (a relative one inside the
    checkpoint's folder, so sweep jobs never export into one another's)."""
    family = family_of(cfg.model.family)
    validate_quantize_block(cfg.quantize, family)
    guidance = settled_guidance(cfg.quantize, "quantize", cfg.model)
    if cfg.cpu_offload and resolve_device(cfg.device).type != "cuda":
        raise UserError(f"cpu_offload=true keeps the networks a GPU is not running in host memory, but device="
                        f"{cfg.device} runs on the CPU: set cpu_offload=false")
    calibration = calibration_of(cfg, family)
    folder = quantized_checkpoint_dir(cfg)
    configs = model_configs(cfg.model)
    geometry = settled_geometry(cfg.quantize, "quantize", cfg.model, configs) if configs else None
    if configs:
        validate_steps(cfg.quantize.n_steps, "quantize.n_steps", configs["scheduler_config"])
    # A null size stays null in the calibration (and so in the checkpoint's fingerprint), but the
    # pipeline is handed the size settled here: diffusers' own default is not always the model's
    # (FluxPipeline draws 128 latent pixels a side whatever the model was trained on).
    block = frozen(cfg.quantize, **guidance, **({} if geometry is None else
                                    {"height": geometry.height, "width": geometry.width, "num_frames": geometry.frames}))
    settled_export = None
    if cfg.run_onnx_export or cfg.run_trt_export:
        out_path = Path(cfg.infer.out_path).expanduser()
        infer = frozen(cfg.infer, out_path=str(out_path if out_path.is_absolute() else folder / out_path))
        settled_export = settle_export(cfg.model, infer, cfg.trt, cfg.onnx, "quantized_backbone", str(folder), None,
                                       cfg.force, cfg.device, cfg.run_onnx_export, cfg.run_trt_export,
                                       checkpoint_to_come=True)
    return Quantize(frozen(cfg.model), family, calibration, folder, block, geometry,
                    calibration.prompts_file, OmegaConf.to_container(cfg, resolve=True), cfg.force, cfg.device,
                    cfg.dtype, cfg.cuda_graph, cfg.cpu_offload, cfg.run_quantization, settled_export)


def run_quantize(cfg) -> Path:
    """quantize.py: calibrates and quantizes the backbones, then exports and builds them when the
    switches ask; returns the checkpoint folder."""
    settled = settle_quantize(cfg)
    quantize(settled)
    if settled.export is not None and parallel.current_world().is_main:
        export(settled.export)
    return settled.folder


def quantize(settled: Quantize) -> None:
    """The settled calibration: reused where a checkpoint of the same settings is complete."""
    start = time.perf_counter()
    fingerprint = settled.calibration.fingerprint()
    attributes = settled.family.backbone_attributes
    if not settled.force and checkpoint.is_complete(settled.folder, fingerprint, attributes):
        print_summary("quantize", [], time.perf_counter() - start,
                      reused=[checkpoint.backbone_file(settled.folder, attribute) for attribute in attributes])
    elif settled.run_quantization:
        _calibrate_and_save(settled, fingerprint, start)
    else:
        raise UserError(f"run_quantization=false but {settled.folder} holds no checkpoint for these settings: "
                        "run with run_quantization=true first")


def _calibrate_and_save(settled: Quantize, fingerprint: str, start: float) -> None:
    """Calibration proper; under torchrun every process calibrates its share and rank 0 saves."""
    world = parallel.current_world()
    family, block = settled.family, settled.block
    prompts = load_prompts(settled.prompts_file, block.calib_size)
    device = parallel.rank_device(resolve_device(settled.device), world)
    parallel.start(world, device)
    try:
        dtype = compute_dtype(device, settled.dtype, family.gpu_dtype)
        with stage("loading the model"):
            pipe = load_pipeline(settled.model, torch.device("cpu") if settled.cpu_offload else device, dtype)
            if settled.cpu_offload:
                pipe.enable_model_cpu_offload(device=device)
        # A single file's VAE is known now.
        validate_image_size(block, "quantize", family.size_multiple(family.vae_scale(pipe.vae.config)), family.size_reason)
        # diffusers' pipeline, which calibration runs, cuts prompts to CLIP's window, as inference does.
        tokenizers = [getattr(pipe, name) for name in family.clip_tokenizers]
        already_told = set() if world.is_main else set(prompts)  # under torchrun, one process says it
        truncated = say_truncated(tokenizers, prompts, already_told, "calibration encodes them cut, as diffusers does")
        with stage("calibration"):
            # Offloading moves the backbones between calls, which a captured graph cannot follow.
            result = quantize_backbones(pipe, family, prompts, block, settled.calibration.seed, world,
                                        settled.cuda_graph and not settled.cpu_offload,
                                        family.calibration_call_kwargs(block))
        backbones = family.backbone_modules(pipe)
        if world.is_main:
            amax = {attribute: activation_amax(module) for attribute, module in backbones.items()}
            record = {
                "fingerprint": fingerprint,
                "settings": settled.calibration.settings(),
                "resolved_config": settled.config,
                "versions": library_versions(),
                "device": str(device),
                "dtype": str(dtype),
                "cpu_offload": settled.cpu_offload,
                **({"peak_gpu_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)}
                   if device.type == "cuda" else {}),
                "job": {"processes": world.size, "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                        "slurm_array_task_id": os.environ.get("SLURM_ARRAY_TASK_ID")},
                "calibration": {
                    "seconds": round(result.seconds, 3),
                    "record_seconds": round(result.record_seconds, 3),
                    "batches": result.batches,
                    "backbone_calls": result.backbone_calls,
                    "steps_served": result.steps_served,
                    "algorithm": result.algorithm,
                    "smoothquant": uses_smoothquant(block.format, block.quant_level),
                    "truncated_prompts": truncated,
                },
                # A one-backbone family's ranges as before, by quantizer; several, by backbone first.
                "amax_summary": _per_backbone(amax, amax_summary),
                "activation_amax": _per_backbone(amax, lambda ranges: ranges),
            }
            with stage(f"saving the checkpoint {settled.folder}"):
                written = checkpoint.save(backbones, settled.folder, record)
            notes = [f"{truncated} of {len(prompts)} calibration prompts are longer than CLIP's {TOKENS} tokens and "
                     "were cut (named above)"] if truncated else []
            scales = {attribute: scale for attribute, scale in result.range_scales(block).items() if scale != 1.0}
            if scales:
                divided = (f"n_steps={block.n_steps}" if len(backbones) == 1
                           else "the steps each backbone served (NeMo's n_steps for one)")
                said = ", ".join(f"{scale:.2g}x" if len(backbones) == 1 else f"{attribute}'s {scale:.2g}x"
                                 for attribute, scale in scales.items())
                notes.append(f"min-mean summed each step's ranges over {result.batches} runs and divided by {divided}, "
                             f"as NeMo does: its ranges are {said} the runs' mean (quantize.mean_divisor=runs takes "
                             "the mean; README: Percentile Quant)")
            print_summary("quantize", written, time.perf_counter() - start, notes=notes)
    finally:
        # Waits for rank 0's save, so no process moves on before the checkpoint exists.
        parallel.stop(world)


def _per_backbone(amax: dict[str, dict], summarize) -> dict:
    """`summarize` of each backbone's ranges: the one backbone's alone, or by backbone."""
    if len(amax) == 1:
        return summarize(next(iter(amax.values())))
    return {attribute: summarize(ranges) for attribute, ranges in amax.items()}
