"""quantize.py: calibrates and quantizes the UNet, then exports and builds it when NeMo's switches ask."""

from __future__ import annotations

import os
import time
from pathlib import Path

from omegaconf import OmegaConf

from ..quantize import checkpoint
from .. import parallel
from ..artifacts import read_json
from ..quantize.calibrate import activation_amax, amax_summary, quantize_backbone
from ..cli import stage
from ..config import ExportApp, validate_export, validate_image_size, validate_quantize_block, validate_steps
from ..errors import UserError
from ..families import family_of
from ..load import calibration_prompts_file, compute_dtype, load_pipeline, load_prompts, model_configs, resolve_device
from ..families.networks import TOKENS
from ..families.pipeline import say_truncated
from ..quantize.recipe import uses_smoothquant
from ..report import library_versions, print_summary
from .settings import settled_image_size
from .export_trt import run_export


def quantized_checkpoint_dir(cfg) -> Path:
    return Path(cfg.out_dir).expanduser() / checkpoint.checkpoint_name(cfg)


def run_quantize(cfg) -> Path:
    """quantize.py: calibrates and quantizes the backbone, then exports and builds it when the
    switches ask; returns the checkpoint folder."""
    start = time.perf_counter()
    validate_quantize_block(cfg.quantize, family_of(cfg.model.family))
    folder = quantized_checkpoint_dir(cfg)
    export_cfg = _chained_export_config(cfg, folder) if cfg.run_onnx_export or cfg.run_trt_export else None
    if export_cfg is not None:
        validate_export(export_cfg)
        export_cfg.infer.height, export_cfg.infer.width = settled_image_size(export_cfg.infer, "infer", cfg.model)
    fingerprint = checkpoint.fingerprint(checkpoint.calibration_settings(cfg))
    if not cfg.force and checkpoint.is_complete(folder, fingerprint):
        print_summary("quantize", [], time.perf_counter() - start, reused=[folder / checkpoint.UNET_FILE])
    elif cfg.run_quantization:
        _say_older_recipe(folder)
        _calibrate_and_save(cfg, folder, fingerprint, start)
    else:
        raise UserError(f"run_quantization=false but {folder} holds no checkpoint for these settings: "
                        "run with run_quantization=true first")
    if export_cfg is not None and parallel.current_world().is_main:
        run_export(export_cfg)
    return folder


def _say_older_recipe(folder: Path) -> None:
    """Names a checkpoint of the same readable settings made before NeMo's recipe (its sidecar has
    no percentile_layers): its fingerprint differs, so it is calibrated again, not reused."""
    prefix = folder.name.rsplit("_", 1)[0]
    for older in sorted(folder.parent.glob(f"{prefix}_*")):
        settings = (read_json(older / checkpoint.SIDECAR_FILE) or {}).get("settings", {})
        if older != folder and "quantize" in settings and "percentile_layers" not in settings["quantize"]:
            print(f"note: {older} was calibrated before NeMo's recipe (Percentile Quant on every layer); "
                  f"calibrating again into {folder}", flush=True)


def _calibrate_and_save(cfg, folder: Path, fingerprint: str, start: float) -> None:
    """Calibration proper; under torchrun every process calibrates its share and rank 0 saves."""
    world = parallel.current_world()
    prompts = load_prompts(calibration_prompts_file(cfg), cfg.quantize.calib_size)
    configs = model_configs(cfg.model)
    block = cfg.quantize
    if configs:
        validate_steps(cfg.quantize.n_steps, "quantize.n_steps", configs["scheduler_config"])
        # A null size stays null in the settings (and so in the checkpoint's fingerprint), but the
        # pipeline is handed the size settled here: diffusers' own default is not always the
        # model's (FluxPipeline draws 128 latent pixels a side whatever the model was trained on).
        height, width = settled_image_size(cfg.quantize, "quantize", cfg.model, configs)
        block = OmegaConf.merge(cfg.quantize, {"height": height, "width": width})
    device = parallel.rank_device(resolve_device(cfg.device), world)
    parallel.start(world, device)
    family = family_of(cfg.model.family)
    try:
        dtype = compute_dtype(device, cfg.dtype, family.gpu_dtype)
        with stage("loading the model"):
            pipe = load_pipeline(cfg.model, device, dtype)
        # A single file's VAE is known now.
        validate_image_size(cfg.quantize, "quantize", family.size_multiple(pipe.vae_scale_factor), family.size_reason)
        # diffusers' pipeline, which calibration runs, cuts prompts to CLIP's window, as inference does.
        tokenizers = [getattr(pipe, name) for name in family.clip_tokenizers]
        already_told = set() if world.is_main else set(prompts)  # under torchrun, one process says it
        truncated = say_truncated(tokenizers, prompts, already_told, "calibration encodes them cut, as diffusers does")
        with stage("calibration"):
            result = quantize_backbone(pipe, family, prompts, block, cfg.seed, world, cfg.cuda_graph)
        backbone = getattr(pipe, family.backbone.attribute)
        if world.is_main:
            amax = activation_amax(backbone)
            sidecar = {
                "fingerprint": fingerprint,
                "settings": checkpoint.calibration_settings(cfg),
                "resolved_config": OmegaConf.to_container(cfg, resolve=True),
                "versions": library_versions(),
                "device": str(device),
                "dtype": str(dtype),
                "job": {"processes": world.size, "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                        "slurm_array_task_id": os.environ.get("SLURM_ARRAY_TASK_ID")},
                "calibration": {
                    "seconds": round(result.seconds, 3),
                    "record_seconds": round(result.record_seconds, 3),
                    "batches": result.batches,
                    "backbone_calls": result.backbone_calls,
                    "algorithm": result.algorithm,
                    "smoothquant": uses_smoothquant(cfg.quantize.format, cfg.quantize.quant_level),
                    "truncated_prompts": truncated,
                },
                "amax_summary": amax_summary(amax),
                "activation_amax": amax,
            }
            with stage(f"saving the checkpoint {folder}"):
                written = checkpoint.save(backbone, folder, sidecar)
            notes = [f"{truncated} of {len(prompts)} calibration prompts are longer than CLIP's {TOKENS} tokens and "
                     "were cut (named above)"] if truncated else []
            scale = result.range_scale(cfg.quantize)
            if scale != 1.0:
                notes.append(f"min-mean summed each step's ranges over {result.batches} runs and divided by "
                             f"n_steps={cfg.quantize.n_steps}, as NeMo does: its ranges are {scale:.2g}x the runs' mean "
                             "(quantize.mean_divisor=runs takes the mean; README: Percentile Quant)")
            print_summary("quantize", written, time.perf_counter() - start, notes=notes)
    finally:
        # Waits for rank 0's save, so no process moves on before the checkpoint exists.
        parallel.stop(world)


def _chained_export_config(cfg, folder: Path):
    """export_trt.py's config for the checkpoint in `folder`, from quantize.py's own blocks."""
    out_path = Path(cfg.infer.out_path).expanduser()
    export_cfg = OmegaConf.structured(ExportApp)
    export_cfg.merge_with({
        "infer": {**OmegaConf.to_container(cfg.infer), "out_path": str(out_path if out_path.is_absolute()
                                                                        else folder / out_path)},
        "trt": cfg.trt, "onnx": cfg.onnx, "model": cfg.model, "quantized_backbone": str(folder),
        "force": cfg.force, "device": cfg.device,
        "run_onnx_export": cfg.run_onnx_export, "run_trt_export": cfg.run_trt_export})
    return export_cfg
