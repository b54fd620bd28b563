"""The quantized UNet on disk: ModelOpt's save/restore file plus a JSON sidecar.

The sidecar is written last, so its presence marks a complete checkpoint; its ``fingerprint``
identifies the settings that produced it, so a rerun with the same settings reuses it.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

from omegaconf import OmegaConf

from .. import lora
from ..artifacts import atomic_path, read_json, write_json
from ..config import plain
from ..errors import UserError
from ..families import family_of
from ..load import calibration_prompts_file

UNET_FILE = "unet.mto"
SIDECAR_FILE = "unet.json"


def model_identity(model, with_loras: bool = True) -> dict:
    """What names a model's weights, for fingerprints of everything made from them; without the
    LoRA adapters for what they never touch (the VAE)."""
    identity = {"family": plain(model.family), "source": model.source, "variant": model.variant}
    adapters = lora.identities(model.loras) if with_loras else []
    # Absent rather than empty without adapters, so the fingerprints made before LoRA support
    # still name the same artifacts.
    return {**identity, "loras": adapters} if adapters else identity


def calibration_settings(cfg) -> dict:
    """Everything that changes the calibrated result, and nothing that does not."""
    settings = {
        "quantize": OmegaConf.to_container(cfg.quantize, resolve=True),
        "model": model_identity(cfg.model),
        "prompts_file": calibration_prompts_file(cfg),
        "seed": cfg.seed,
    }
    # Only where the recipe changed, so the fingerprints of the checkpoints it did not change hold.
    revisions = family_of(cfg.model.family).recipe_revisions(cfg.quantize.format, cfg.quantize.quant_level)
    return {**settings, "recipe": revisions} if revisions else settings


def fingerprint(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def checkpoint_name(cfg) -> str:
    """The usual sweep keys, readable, then the settings' fingerprint: unique per setting, so
    sweep jobs never write into each other's folders whatever they sweep."""
    q = cfg.quantize
    return (f"{q.exp_name}_{cfg.model.name}_{plain(q.format)}"
            f"_l{q.quant_level:g}_a{q.alpha:g}_{q.collect_method}_p{q.percentile:g}"
            f"_s{q.n_steps}_c{q.calib_size}_b{q.batch_size}_seed{cfg.seed}"
            f"_{fingerprint(calibration_settings(cfg))[:8]}")


def is_complete(folder: Path, expected_fingerprint: str) -> bool:
    sidecar = read_json(folder / SIDECAR_FILE)
    return (sidecar is not None and sidecar.get("fingerprint") == expected_fingerprint
            and (folder / UNET_FILE).is_file())


def save(unet, folder: Path, sidecar: dict) -> list[Path]:
    import modelopt.torch.opt as mto

    folder.mkdir(parents=True, exist_ok=True)
    (folder / SIDECAR_FILE).unlink(missing_ok=True)
    with atomic_path(folder / UNET_FILE) as temp:
        mto.save(unet, temp)
    write_json(folder / SIDECAR_FILE, sidecar)
    return [folder / UNET_FILE, folder / SIDECAR_FILE]


def check_readable(path: Path, key: str) -> dict:
    """Refuses, before any work, a checkpoint (folder or unet.mto) that is missing, cut short or
    without its sidecar; returns the sidecar. The file's zip directory sits at its end, so a
    truncated file is caught without reading the weights."""
    folder = path if path.is_dir() else path.parent
    checkpoint = folder / UNET_FILE if path.is_dir() else path
    if not checkpoint.is_file():
        raise UserError(f"{key}={path}: {checkpoint} does not exist: run quantize.py first")
    if not zipfile.is_zipfile(checkpoint):
        raise UserError(f"{key}={path}: {checkpoint} is truncated or corrupt: run quantize.py again with force=true")
    sidecar = read_json(folder / SIDECAR_FILE)
    if not isinstance(sidecar, dict) or "fingerprint" not in sidecar:
        raise UserError(f"{key}={path}: its record {folder / SIDECAR_FILE} is missing or unreadable: run "
                        "quantize.py again with force=true")
    return sidecar


def restore(unet, folder: Path):
    """Puts the quantizers, calibrated ranges and (smoothed) weights from `folder` into `unet`.

    `unet` may be built on the meta device: the checkpoint holds every weight, which are then
    taken from the memory-mapped file instead of being copied over weights loaded for nothing.
    """
    import modelopt.torch.opt as mto
    from modelopt.torch.opt.conversion import safe_load

    folder = Path(folder)
    checkpoint = folder / UNET_FILE if folder.is_dir() else folder
    if not checkpoint.is_file():
        raise UserError(f"quantized checkpoint {checkpoint} does not exist: run quantize.py first")
    try:
        saved = safe_load(str(checkpoint), map_location="cpu", mmap=True)
        restored = mto.restore_from_modelopt_state(unet, saved["modelopt_state"])
        restored.load_state_dict(saved["model_state_dict"], assign=True)
        return restored
    except (RuntimeError, KeyError, ValueError, AssertionError) as error:
        raise UserError(
            f"quantized checkpoint {checkpoint} does not belong to this model "
            f"({type(error).__name__}: {str(error).splitlines()[0][:200]}): quantize this model "
            "again or choose the checkpoint made from it"
        ) from error
