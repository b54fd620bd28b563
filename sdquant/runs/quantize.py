"""quantize.py's config settled: the calibration (what makes the checkpoint, and its folder) and,
where NeMo's switches ask, the export of the checkpoint to come, settled as export_trt.py settles
its own: two settled runs, which the script runs one after the other."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..config import ExportApp, QuantizeApp, QuantizeBlock, freeze, settled_config, validate_quantize_block, \
    validate_steps
from ..errors import UserError
from ..graphs.geometry import SampleGeometry
from ..load import load_prompts, resolve_device
from ..quantize import checkpoint
from ..quantize.recipe import recipe_identity
from .export import ExportRun, settle_export_app
from .infer import checked_out_path
from .model import Model, settle_model


@dataclass(frozen=True)
class QuantizeRun:
    """A calibration settled: the model, what identifies the checkpoint and its folder, the quantize
    block with the guidance and geometry filled in (a null size stays null in the calibration's
    identity, as in the checkpoints made before), the prompts, the switches, the device."""

    model: Model
    calibration: checkpoint.Calibration
    folder: Path
    block: QuantizeBlock
    geometry: SampleGeometry | None
    prompts: tuple[str, ...]
    config: dict
    force: bool
    device: str
    dtype: str
    cuda_graph: bool
    cpu_offload: bool
    run_quantization: bool

    @property
    def family(self):
        return self.model.family


@dataclass(frozen=True)
class QuantizeScript:
    """quantize.py settled: its calibration and, where the switches ask, the export that follows."""

    calibration: QuantizeRun
    export: ExportRun | None


def settle_quantize(cfg) -> QuantizeScript:
    """quantize.py's config, every value checked before any work: the recipe, the model and the
    geometry (from the model's configs where its folder states them), the steps and, where the
    switches ask for the export, the export of the checkpoint into infer.out_path (a relative one
    inside the checkpoint's folder, so sweep jobs never export into one another's)."""
    app: QuantizeApp = settled_config(cfg)
    validate_quantize_block(app.quantize)
    model = settle_model(app.model, drawing=False)
    check_level(model, app.quantize)
    check_high_precision_blocks(model, app.quantize)
    if app.cpu_offload and resolve_device(app.device).type != "cuda":
        raise UserError(f"cpu_offload=true keeps the networks a GPU is not running in host memory, but device="
                        f"{app.device} runs on the CPU: set cpu_offload=false")
    block = app.quantize
    asked = (block.height, block.width, block.num_frames, None, block.guidance_scale, block.guidance_scale_2)
    sample = model.family.settle_sample(model.config, model.parts, "quantize.", *asked) \
        if model.parts or None not in (block.height, block.width) else None
    if "scheduler_config" in model.parts:
        validate_steps(block.n_steps, "quantize.n_steps", model.parts["scheduler_config"])
        check_steps_served(model, block.n_steps)
    calibration = calibration_of(app, model, sample)
    folder = checked_out_path(app.out_dir, "out_dir") / calibration.folder_name()
    # A null size stays null in the calibration (and so in the checkpoint's fingerprint), but the
    # pipeline is handed the size settled here: diffusers' own default is not always the model's
    # (FluxPipeline draws 128 latent pixels a side whatever the model was trained on).
    guidance = settled_guidance(model, block)
    settled_block = freeze(dataclasses.replace(block, **guidance, **({} if sample is None else {
        "height": sample.geometry.height, "width": sample.geometry.width, "num_frames": sample.geometry.frames})))
    prompts = tuple(load_prompts(calibration.prompts_file, block.calib_size))
    run = QuantizeRun(model, calibration, folder, settled_block, None if sample is None else sample.geometry, prompts,
                      dataclasses.asdict(app), app.force, app.device, app.dtype, app.cuda_graph, app.cpu_offload,
                      app.run_quantization)
    return QuantizeScript(run, _export_of(app, model, folder))


def _export_of(app: QuantizeApp, model: Model, folder: Path) -> ExportRun | None:
    """The export NeMo's switches ask of the checkpoint to come, into infer.out_path (a relative one
    inside the checkpoint's folder)."""
    if not (app.run_onnx_export or app.run_trt_export):
        return None
    out_path = Path(app.infer.out_path).expanduser()
    infer = dataclasses.replace(app.infer, out_path=str(out_path if out_path.is_absolute() else folder / out_path))
    export = ExportApp(infer=infer, trt=app.trt, onnx=app.onnx, model=app.model, quantized_backbone=str(folder),
                       force=app.force, device=app.device, run_onnx_export=app.run_onnx_export,
                       run_trt_export=app.run_trt_export)
    return settle_export_app(freeze(export), model, checkpoint_to_come=True)


def check_steps_served(model: Model, steps: int) -> None:
    """Refuses a calibration in which a backbone (a two-expert model's) serves none of the steps,
    which would leave it without ranges."""
    for attribute, served in model.family.backbone_steps(model.parts, steps).items():
        if not served:
            raise UserError(f"quantize.n_steps={steps}: model={model.name}'s {attribute} serves none of the "
                            f"{steps} calibration steps (the experts split them at the model's noise boundary), so "
                            "it would have no ranges: give more quantize.n_steps")


def check_level(model: Model, block: QuantizeBlock) -> None:
    """Refuses a quant_level the model's family has no recipe for."""
    level = float(block.quant_level)
    levels = model.family.level_table.levels
    if level not in levels:
        raise UserError(f"quantize.quant_level={level:g} is not a level of {model.family.name} models: choose one of "
                        f"{', '.join(f'{each:g}' for each in levels)}"
                        + (" (a DiT has no convolutions for level 1)" if level == 1.0 else ""))


def check_high_precision_blocks(model: Model, block: QuantizeBlock) -> None:
    """Refuses quantize.high_precision_blocks where the family's recipe numbers no blocks, and
    indices the model's backbone does not have (where its config says how many it has)."""
    blocks, table = block.high_precision_blocks, model.family.level_table
    if blocks is None:
        return
    key = f"quantize.high_precision_blocks={list(blocks)}"
    if table.block_pattern is None:
        raise UserError(f"{key}: the recipe of {model.family.name} models keeps no numbered blocks in 16 bits; "
                        "leave it null")
    if any(index < 0 for index in blocks) or len(set(blocks)) != len(blocks):
        raise UserError(f"{key}: give each block's index (0 or more) once")
    count = (model.parts.get("backbone_config") or {}).get(table.block_count_key)
    if count is not None and max(blocks, default=0) >= count:
        raise UserError(f"{key}: model={model.name}'s backbone has blocks 0 to {count - 1}")


def settled_guidance(model: Model, block: QuantizeBlock) -> dict:
    """The quantize block's guidance, each null scale the model's own (ModelFamily.settle_guidance)."""
    scales = model.family.settle_guidance(model.config, "quantize.", block.guidance_scale, block.guidance_scale_2)
    return dict(zip(("guidance_scale", "guidance_scale_2"), scales))


def calibration_of(app: QuantizeApp, model: Model, sample=None) -> checkpoint.Calibration:
    """What identifies the checkpoint `app` makes: the quantize block, the model's identity, the
    prompts, the seed and the recipe as data (the family's level table and what it makes of it,
    sdquant.quantize.recipe.recipe_identity). The guidance is the settled one (a null scale the
    model's), so a checkpoint of a model's own guidance is the same whether asked for by value or by
    null. A video model's geometry is the one its config settles to, since a null size or frame count
    takes the model config's own, which the model's identity does not hold. `sample`: the settled
    one (ModelFamily.settle_sample), which a video model's needs."""
    family = model.family
    block = dataclasses.asdict(app.quantize) | settled_guidance(model, app.quantize)
    if family.output == "video":
        geometry = sample.geometry
        block.update(height=geometry.height, width=geometry.width, num_frames=geometry.frames)
    return checkpoint.Calibration(
        quantize=block, model=checkpoint.model_identity(app.model), model_name=app.model.name,
        prompts_file=app.prompts_file or app.model.calib_prompts, seed=app.seed,
        recipe=recipe_identity(family.level_table, app.quantize, family.attention_projections))
