"""The quantized backbones on disk: one folder per calibration run, holding ModelOpt's save/restore
file of each backbone, named by its attribute on the pipeline (unet.mto, transformer.mto,
transformer_2.mto), and a JSON record.

The record is written last, so its presence marks a complete checkpoint; its ``fingerprint``
identifies the settings that produced it, so a rerun with the same settings reuses it. What older
sdquant wrote and this one no longer reads is refused in sdquant.quantize.compat.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .. import lora
from ..artifacts import atomic_path, read_json, write_json
from ..config import plain
from ..errors import UserError
from . import compat

RECORD_FILE = "checkpoint.json"
BACKBONE_SUFFIX = ".mto"


def model_identity(model, with_loras: bool = True) -> dict:
    """What names a model's weights, for fingerprints of everything made from them; without the
    LoRA adapters for what they never touch (the VAE)."""
    identity = {"family": model.family, "source": model.source, "variant": model.variant}
    adapters = lora.identities(model.loras) if with_loras else []
    # Absent rather than empty without adapters, so the fingerprints made before LoRA support
    # still name the same artifacts.
    return {**identity, "loras": adapters} if adapters else identity


def fingerprint(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Calibration:
    """Everything that changes a calibration's result, and nothing that does not: the quantize
    block (plain values), the model's identity, the prompts file, the seed and the recipe as data
    (sdquant.quantize.recipe.recipe_identity: the family's level table and what is derived from it)."""

    quantize: dict
    model: dict
    model_name: str
    prompts_file: str | None
    seed: int
    recipe: dict

    def settings(self) -> dict:
        return {"quantize": self.quantize, "model": self.model, "prompts_file": self.prompts_file,
                "seed": self.seed, "recipe": self.recipe}

    def fingerprint(self) -> str:
        return fingerprint(self.settings())

    def folder_name(self) -> str:
        """The usual sweep keys, readable, then the settings' fingerprint: unique per setting, so
        sweep jobs never write into each other's folders whatever they sweep."""
        q = self.quantize
        return (f"{q['exp_name']}_{self.model_name}_{plain(q['format'])}"
                f"_l{q['quant_level']:g}_a{q['alpha']:g}_{q['collect_method']}_p{q['percentile']:g}"
                f"_s{q['n_steps']}_c{q['calib_size']}_b{q['batch_size']}_seed{self.seed}_{self.fingerprint()[:8]}")


def backbone_file(folder: Path, attribute: str) -> Path:
    """The file of backbone `attribute` in a checkpoint folder."""
    return folder / f"{attribute}{BACKBONE_SUFFIX}"


def is_complete(folder: Path, expected_fingerprint: str, attributes: tuple[str, ...]) -> bool:
    record = read_json(folder / RECORD_FILE)
    return (record is not None and record.get("fingerprint") == expected_fingerprint
            and all(backbone_file(folder, attribute).is_file() for attribute in attributes))


def save(backbones: dict[str, object], folder: Path, record: dict) -> list[Path]:
    """Writes each backbone (by attribute) to its file, then the record; returns the files."""
    import modelopt.torch.opt as mto

    folder.mkdir(parents=True, exist_ok=True)
    (folder / RECORD_FILE).unlink(missing_ok=True)
    written = []
    for attribute, module in backbones.items():
        path = backbone_file(folder, attribute)
        with atomic_path(path) as temp:
            mto.save(module, temp)
        written.append(path)
    write_json(folder / RECORD_FILE, {**record, "backbones": list(backbones)})
    return [*written, folder / RECORD_FILE]


def checkpoint_folder(path: Path, key: str, attributes: tuple[str, ...]) -> Path:
    """The folder config `key` names: itself, or the folder of a backbone file it names (NeMo's
    quantized_unet=<folder>/unet.mto), which names all of a one-backbone family's checkpoint."""
    if path.is_dir() or not path.suffix == BACKBONE_SUFFIX:
        return path
    if len(attributes) > 1:
        raise UserError(f"{key}={path} names one backbone's file, but the model has {len(attributes)} "
                        f"({', '.join(attributes)}): give the checkpoint folder, {path.parent}")
    return path.parent


def read_record(path: Path, key: str, attributes: tuple[str, ...]) -> dict:
    """The record of the checkpoint config `key` names, refused in one line where it is missing,
    unreadable (which also says whether a checkpoint is there at all) or written by an sdquant whose
    checkpoints this one no longer reads."""
    folder = checkpoint_folder(path, key, attributes)
    record = read_json(folder / RECORD_FILE) if folder.is_dir() else None
    if not isinstance(record, dict) or "fingerprint" not in record:
        compat.refuse_older_layout(folder, key, path)
        if not folder.is_dir() or not any(folder.glob(f"*{BACKBONE_SUFFIX}")):
            raise UserError(f"{key}={path}: no quantize.py checkpoint there: run quantize.py first")
        raise UserError(f"{key}={path}: its record {folder / RECORD_FILE} is missing or unreadable: run "
                        "quantize.py again with force=true")
    compat.refuse_older_recipe(record, key, path)
    return record


def check_backbone_files(path: Path, key: str, attributes: tuple[str, ...]) -> None:
    """Refuses, before any work, a checkpoint without one of the model's backbones (`attributes`) or
    with one cut short. A file's zip directory sits at its end, so a truncated file is caught without
    reading the weights."""
    folder = checkpoint_folder(path, key, attributes)
    for attribute in attributes:
        checkpoint = backbone_file(folder, attribute)
        if not checkpoint.is_file():
            held = sorted(p.name for p in folder.glob(f"*{BACKBONE_SUFFIX}"))
            holds = f"it holds {', '.join(held)}" if held else "no backbone file is there"
            raise UserError(f"{key}={path}: {checkpoint} does not exist ({holds}): give a quantize.py checkpoint "
                            "of this model, or run quantize.py first")
        if not zipfile.is_zipfile(checkpoint):
            raise UserError(f"{key}={path}: {checkpoint} is truncated or corrupt: run quantize.py again with force=true")


def restore(backbone, folder: Path, attribute: str):
    """Puts the quantizers, calibrated ranges and (smoothed) weights of backbone `attribute` in
    `folder` into `backbone`.

    `backbone` may be built on the meta device: the checkpoint holds every weight, which are then
    taken from the memory-mapped file instead of being copied over weights loaded for nothing.
    """
    import modelopt.torch.opt as mto
    from modelopt.torch.opt.conversion import safe_load

    checkpoint = backbone_file(Path(folder), attribute)
    if not checkpoint.is_file():
        raise UserError(f"quantized checkpoint {checkpoint} does not exist: run quantize.py first")
    try:
        saved = safe_load(str(checkpoint), map_location="cpu", mmap=True)
        restored = mto.restore_from_modelopt_state(backbone, saved["modelopt_state"])
        restored.load_state_dict(saved["model_state_dict"], assign=True)
        return restored
    except (RuntimeError, KeyError, ValueError, AssertionError) as error:
        raise UserError(
            f"quantized checkpoint {checkpoint} does not belong to this model "
            f"({type(error).__name__}: {str(error).splitlines()[0][:200]}): quantize this model "
            "again or choose the checkpoint made from it"
        ) from error
