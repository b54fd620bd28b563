"""quantize.py: calibrates and quantizes the model's backbones, then exports and builds them when
NeMo's switches ask: two runs settled at the start (sdquant.runs.quantize), run one after the other."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from ..quantize import checkpoint
from .. import parallel
from ..quantize.calibrate import activation_amax, amax_summary, quantize_backbones
from ..cli import stage
from ..config import sizes_of, validate_image_size
from ..errors import UserError
from ..load import compute_dtype, load_pipeline, resolve_device
from ..graphs.networks import TOKENS
from ..families.pipeline import say_truncated
from ..quantize.recipe import uses_smoothquant
from ..report import library_versions, print_summary
from ..runs.quantize import QuantizeRun, settle_quantize
from .export_trt import export


def run_quantize(cfg) -> Path:
    """quantize.py at its edge: the config settled (the calibration, and the export the switches ask
    for), then the calibration and, on the main process, the export; returns the checkpoint folder."""
    settled = settle_quantize(cfg)
    calibrate(settled.calibration)
    if settled.export is not None and parallel.current_world().is_main:
        export(settled.export)
    return settled.calibration.folder


def calibrate(run: QuantizeRun) -> None:
    """The settled calibration: reused where a checkpoint of the same settings is complete."""
    start = time.perf_counter()
    fingerprint = run.calibration.fingerprint()
    attributes = run.family.backbone_attributes
    if not run.force and checkpoint.is_complete(run.folder, fingerprint, attributes):
        print_summary("quantize", [], time.perf_counter() - start,
                      reused=[checkpoint.backbone_file(run.folder, attribute) for attribute in attributes])
    elif run.run_quantization:
        _calibrate_and_save(run, fingerprint, start)
    else:
        raise UserError(f"run_quantization=false but {run.folder} holds no checkpoint for these settings: "
                        "run with run_quantization=true first")


def _calibrate_and_save(settled: QuantizeRun, fingerprint: str, start: float) -> None:
    """Calibration proper; under torchrun every process calibrates its share and rank 0 saves."""
    world = parallel.current_world()
    family, block = settled.family, settled.block
    prompts = list(settled.prompts)
    device = parallel.rank_device(resolve_device(settled.device), world)
    parallel.start(world, device)
    try:
        dtype = compute_dtype(device, settled.dtype, family.gpu_dtype)
        with stage("loading the model"):
            pipe = load_pipeline(settled.model.config, torch.device("cpu") if settled.cpu_offload else device, dtype)
            if settled.cpu_offload:
                pipe.enable_model_cpu_offload(device=device)
        # A single file's VAE is known now.
        validate_image_size(sizes_of(block), "quantize.", family.size_multiple(family.vae_scale(pipe.vae.config)),
                            family.size_reason)
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
                             "the mean; docs/reference.md: Percentile Quant)")
            print_summary("quantize", written, time.perf_counter() - start, notes=notes)
    finally:
        # Waits for rank 0's save, so no process moves on before the checkpoint exists.
        parallel.stop(world)


def _per_backbone(amax: dict[str, dict], summarize) -> dict:
    """`summarize` of each backbone's ranges: the one backbone's alone, or by backbone."""
    if len(amax) == 1:
        return summarize(next(iter(amax.values())))
    return {attribute: summarize(ranges) for attribute, ranges in amax.items()}
