"""model.* and a quantize.py checkpoint, settled: the model's family, what its folder declares (read
once), and a checkpoint checked against them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import load, lora
from ..config import ModelConfig
from ..errors import UserError
from ..families import family_of
from ..families.base import ModelFamily
from ..quantize import checkpoint


@dataclass(frozen=True)
class Model:
    """A model settled: its config (read-only), its family, and what its folder declares: the
    scheduler, backbone and VAE configs (none for a single file without model.single_file_config)
    and, where the run draws, its tokenizers and pipeline config."""

    config: ModelConfig
    family: ModelFamily
    parts: dict

    @property
    def name(self) -> str:
        return self.config.name


def settle_model(config: ModelConfig, drawing: bool) -> Model:
    """`config` checked and its folder read once, without weights: its configs, and where the run
    draws (`drawing`: infer_trt.py, evaluate.py, the Python API) its tokenizers too."""
    family = family_of(config.family)
    lora.adapters(config.loras)
    parts = load.pipeline_parts(config) if drawing else load.model_configs(config)
    if parts:
        family.check_declared(config, parts)
    return Model(config, family, parts)


@dataclass(frozen=True)
class Checkpoint:
    """A quantize.py checkpoint a run reads: the config key and value that named it, its folder and
    its record."""

    key: str
    value: str
    # None: the backbones hold it already (fake-quantized in memory, as a benchmark makes them).
    folder: Path | None
    record: dict

    @classmethod
    def in_memory(cls, named: str, fmt: str, quant_level: float) -> "Checkpoint":
        """Backbones fake-quantized in memory at this format and level, named `named` in messages."""
        return cls(named, "in memory", None, {"settings": {"quantize": {"format": fmt, "quant_level": quant_level}}})

    @property
    def named(self) -> str:
        """The config key and value that named it, for messages (an in-memory one's name alone)."""
        return self.key if self.folder is None else f"{self.key}={self.value}"

    @property
    def format(self) -> str:
        return self.record["settings"]["quantize"]["format"]

    @property
    def quant_level(self) -> float:
        return self.record["settings"]["quantize"]["quant_level"]


def settle_checkpoint(model: Model, key: str, value: str) -> Checkpoint:
    """Refuses, before any work, a checkpoint that config `key` names if it is missing, truncated,
    without one of the model's backbones, or made from another model or other LoRA adapters."""
    family = model.family
    path = Path(value).expanduser()
    record = checkpoint.read_record(path, key, family.backbone_attributes)
    made_for = record.get("settings", {}).get("model", {}).get("family")
    if made_for is not None and made_for != model.config.family:
        raise UserError(f"{key}={path} was made from a {made_for} model, not from "
                        f"model={model.name} ({model.config.family}): choose its own model")
    checkpoint.check_backbone_files(path, key, family.backbone_attributes)
    served = record.get("calibration", {}).get("steps_served", {})
    idle = [attribute for attribute, steps in served.items() if not steps]
    if idle:
        raise UserError(f"{key}={path}: its {' and '.join(idle)} served none of the calibration's steps and has no "
                        "ranges: quantize again with more quantize.n_steps")
    made_with = record.get("settings", {}).get("model", {}).get("loras", [])
    named = lora.identities(model.config.loras)
    if made_with != named:
        raise UserError(f"{key}={path} was calibrated with {lora.describe(made_with)}, but model.loras gives "
                        f"{lora.describe(named)}: set model.loras as the checkpoint was made, or quantize again")
    folder = checkpoint.checkpoint_folder(path, key, family.backbone_attributes)
    return Checkpoint(key, value, folder, record)


def config_digest(config: dict) -> str:
    """A digest of a network's config as its folder states it (its own keys, not diffusers'
    bookkeeping), which an exported graph records to be told apart from another model's."""
    return checkpoint.fingerprint({key: value for key, value in config.items() if not key.startswith("_")})


def check_graph_made_for(path: Path, named: str, model: Model, geometry) -> None:
    """Refuses a backbone graph exported (export_trt.py records it beside the graph) from a model of
    another backbone config, or traced at a geometry other than the run's where its sizes are fixed;
    a graph without those records is taken as it is. `named`: the config key and value that led to
    it, for messages."""
    from ..artifacts import read_json
    from ..export.onnx_graphs import META_FILE

    made = read_json(path.parent / META_FILE) or {}
    if made.get("backbone_config") not in (None, config_digest(model.parts["backbone_config"])):
        raise UserError(f"{named} was exported from a model whose {model.family.configs_backbone.attribute} "
                        f"differs from model={model.name}'s: give the graph exported from it (export_trt.py "
                        f"model={model.name})")
    traced = made.get("traced_geometry")
    if traced is not None and traced != [geometry.frames, geometry.height, geometry.width]:
        frames, height, width = traced
        raise UserError(f"{named} is fixed at {frames} frames of {height}x{width} (its sizes are the export's), "
                        f"and this run draws {geometry.describe()}: draw at its geometry, or export at this one "
                        "(export_trt.py infer.num_frames, infer.height, infer.width)")
