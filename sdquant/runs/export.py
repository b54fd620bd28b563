"""export_trt.py's config settled (quantize.py settles the export of the checkpoint it makes the same
way): the model, the engines' batch and geometry, the TensorRT and ONNX blocks, the checkpoint, the
step cache the engines are for and the switches."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..config import ExportApp, InferBlock, OnnxBlock, TrtBlock, freeze, quantized_backbone, settled_config, \
    validate_export
from ..graphs.geometry import SampleGeometry
from .infer import checked_out_path
from .model import Model, settle_checkpoint, settle_model
from .sample import say_size, settle_cache


@dataclass(frozen=True)
class ExportRun:
    """An export settled: the model, the export folder and the engines' batch and geometry (`infer`,
    its size and frames filled in), the TensorRT and ONNX blocks, the checkpoint and the key that
    named it, the step cache and the switches."""

    model: Model
    infer: InferBlock
    geometry: SampleGeometry
    trt: TrtBlock
    onnx: OnnxBlock
    checkpoint_key: str
    checkpoint: str | None
    cache: object | None
    force: bool
    device: str
    run_onnx_export: bool
    run_trt_export: bool
    run_refit: bool = False

    @property
    def family(self):
        return self.model.family

    @property
    def out_path(self) -> Path:
        return Path(self.infer.out_path)


def settle_export(cfg) -> ExportRun:
    """export_trt.py's config settled."""
    app: ExportApp = settled_config(cfg)
    return settle_export_app(app, settle_model(app.model, drawing=False))


def settle_export_app(app: ExportApp, model: Model, checkpoint_to_come: bool = False) -> ExportRun:
    """An export of `model` as `app` asks, every value checked before any work: the blocks' values,
    the output folder, the engines' geometry (a null size the model's native one), the checkpoint
    (when it is exported, and not one the run is to make first, `checkpoint_to_come`), the step
    cache the engines are for."""
    validate_export(app.infer, app.trt, app.onnx)
    checked_out_path(app.infer.out_path, "infer.out_path")
    key, folder = quantized_backbone(app)
    if folder and app.run_onnx_export and not app.run_refit and not checkpoint_to_come:
        settle_checkpoint(model, key, folder)
    geometry = model.family.settle_sample(model.config, model.parts, "infer.", app.infer.height, app.infer.width,
                                          app.infer.num_frames, None, None, None).geometry
    say_size(geometry, (app.infer.height, app.infer.width))
    cache = None if app.run_refit else settle_cache(model, app.cache, "cache")
    check_cache_exported(cache)
    infer = freeze(dataclasses.replace(app.infer, height=geometry.height, width=geometry.width,
                                       num_frames=geometry.frames))
    return ExportRun(model, infer, geometry, app.trt, app.onnx, key, folder, cache, app.force, app.device,
                     app.run_onnx_export, app.run_trt_export, app.run_refit)


def check_cache_exported(cache) -> None:
    """Refuses engines for a step cache that is a hook on the module, which no graph holds."""
    from .infer import check_cache_runs

    check_cache_runs(cache, "cache", "trt", cuda_graph=False)
