"""What each script does, stage by stage; the scripts themselves only hand over the config."""

from __future__ import annotations

import time
from pathlib import Path

from omegaconf import OmegaConf

from . import checkpoint
from .calibrate import activation_amax, amax_summary, quantize_unet
from .config import validate_quantize_block
from .load import compute_dtype, load_pipeline, load_prompts, resolve_device
from .report import library_versions, print_summary
from .recipe import uses_smoothquant


def quantized_checkpoint_dir(cfg) -> Path:
    return Path(cfg.out_dir).expanduser() / checkpoint.checkpoint_name(cfg)


def run_quantize(cfg) -> Path:
    """Calibrates and quantizes the UNet; returns the checkpoint folder."""
    start = time.perf_counter()
    validate_quantize_block(cfg.quantize)
    prompts = load_prompts(cfg.prompts_file, cfg.quantize.calib_size)
    settings = checkpoint.calibration_settings(cfg)
    fingerprint = checkpoint.fingerprint(settings)
    folder = quantized_checkpoint_dir(cfg)
    if not cfg.force and checkpoint.is_complete(folder, fingerprint):
        print_summary("quantize", [], time.perf_counter() - start,
                      reused=[folder / checkpoint.UNET_FILE])
        return folder

    device = resolve_device(cfg.device)
    dtype = compute_dtype(device)
    pipe = load_pipeline(cfg.model, device, dtype)
    result = quantize_unet(pipe, prompts, cfg.quantize, cfg.seed)
    amax = activation_amax(pipe.unet)
    sidecar = {
        "fingerprint": fingerprint,
        "settings": settings,
        "resolved_config": OmegaConf.to_container(cfg, resolve=True),
        "versions": library_versions(),
        "device": str(device),
        "dtype": str(dtype),
        "calibration": {
            "seconds": round(result.seconds, 3),
            "record_seconds": round(result.record_seconds, 3),
            "batches": result.batches,
            "unet_calls": result.unet_calls,
            "algorithm": result.algorithm,
            "smoothquant": uses_smoothquant(cfg.quantize.format, cfg.quantize.quant_level),
        },
        "amax_summary": amax_summary(amax),
        "activation_amax": amax,
    }
    written = checkpoint.save(pipe.unet, folder, sidecar)
    print_summary("quantize", written, time.perf_counter() - start)
    return folder
