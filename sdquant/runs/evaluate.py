"""evaluate.py's config settled: the unquantized reference pipeline, each variant's backbones (a
checkpoint, an ONNX file or an engine, with the step cache it runs), the prompt batches, where the
report goes and the metrics."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import parallel
from ..config import AttentionWindowBlock, EvaluateApp, MetricsBlock, ShardBlock, settled_config, validate_evaluate
from ..errors import UserError
from ..export.onnx_graphs import check_graph_file
from ..load import SINGLE_FILE_SUFFIXES
from ..runtime.attention_window import check_attention_window
from .infer import PipelineRun, StageFile, check_cache_runs, check_kernels, checked_out_path
from .model import Model, check_graph_made_for, settle_checkpoint, settle_model
from .sample import Sampling, settle_cache, settle_sampling

ENGINE_SUFFIXES = (".plan", ".engine")


@dataclass(frozen=True)
class Variant:
    """One variant settled: what its source is (unquantized, checkpoint, onnx, engine), the source as
    given, the pipeline of its backbones (built sharing the reference's other stages) and the step
    cache it runs with."""

    kind: str
    source: str | None
    pipeline: PipelineRun
    cache: object | None

    def describe(self) -> str:
        source = str(self.source or "the unquantized backbone again (self-check)")
        window = self.pipeline.torch_backend.attention_window
        if window.frames is not None:
            source += f", attention within {window.frames} frames" + (
                f" on {', '.join(window.backbones)}" if window.backbones is not None else "") + (
                f" but blocks {', '.join(map(str, window.dense_blocks))}" if window.dense_blocks else "") + (
                f", heads of {window.min_share:g} of their attention inside ({window.heads_file})"
                if window.heads_file else "")
        return source if self.cache is None else f"{source}, cached ({self.cache.describe()})"


@dataclass(frozen=True)
class EvaluateRun:
    """evaluate.py settled: the reference pipeline (the unquantized backbones, eager), the variants,
    the prompt batches (uncached: each variant runs its own cache), the shard of them this job
    runs, the report's folder and the metrics."""

    reference: PipelineRun
    variants: dict[str, Variant]
    sampling: Sampling
    shard: ShardBlock
    out_path: Path
    metrics: MetricsBlock

    @property
    def model(self) -> Model:
        return self.reference.model


def settle_evaluate(cfg) -> EvaluateRun:
    """evaluate.py's config, every value checked before any work: the variants' sources (refusing
    checkpoints and graphs cut short or made from another model), each one's step cache against
    what it runs on, the sampling, the output folder."""
    app: EvaluateApp = settled_config(cfg)
    validate_evaluate(app)
    model = settle_model(app.model, drawing=True)
    sampling = settle_sampling(model, app.sampling)
    runs = tuple(dataclasses.replace(settings, cache=None) for settings in sampling.runs)
    reference = PipelineRun(model, "torch", app.device, sampling.scheduler,
                            torch_backend=dataclasses.replace(app.torch_backend, attention_window=AttentionWindowBlock()),
                            dtype=app.dtype)
    variants = {name: _variant(app, model, reference, name, source, sampling.first.geometry)
                for name, source in app.variants.items()}
    parallel.shard(list(runs), parallel.share_of(parallel.current_world(), app.shard),
                   "prompt batches (prompts / sampling.batch_size)")
    return EvaluateRun(reference, variants, dataclasses.replace(sampling, runs=runs), app.shard,
                       checked_out_path(app.out_path, "out_path"), app.metrics)


def _variant(app: EvaluateApp, model: Model, reference: PipelineRun, name: str, source: str | None,
             geometry) -> Variant:
    """Variant `name` settled: its kind, the pipeline run of its backbones, its step cache (its own,
    variant_cache.<name>, else sampling.cache) and attention window (variant_window.<name>, else
    torch_backend.attention_window) checked for what it runs on."""
    kind = _variant_kind(model, name, source, geometry)
    key = f"variant_cache.{name}" if name in app.variant_cache else "sampling.cache"
    block = app.variant_cache.get(name, app.sampling.cache)
    cache = settle_cache(model, block, key)
    if cache is not None and kind in ("onnx", "engine"):
        raise UserError(f"{key}.method={block.method} runs on the diffusers modules in evaluate.py (the unquantized "
                        "backbone or a quantize.py checkpoint): a graph or engine variant is one file, and a cached "
                        "backbone runs two (infer_trt.py runs the cached graphs and engines)")
    check_cache_runs(cache, key, "torch", cuda_graph=False)
    if kind == "engine" and not torch.cuda.is_available():
        raise UserError(f"variants.{name}={source}: a TensorRT engine runs on a CUDA GPU and none is visible here: "
                        "give its .onnx file (ONNX Runtime runs it here)")
    window_key = f"variant_window.{name}" if name in app.variant_window else "torch_backend.attention_window"
    window = app.variant_window.get(name, app.torch_backend.attention_window)
    if window.record_to:
        raise UserError(f"{window_key}.record_to: infer_trt.py records the heads' shares; evaluate.py scores a "
                        "window with heads_file")
    checkpoint = settle_checkpoint(model, f"variants.{name}", source) if kind == "checkpoint" else None
    check_attention_window(model, window, window_key, {"onnx": "onnxruntime", "engine": "trt"}.get(kind, "torch"),
                           app.torch_backend, checkpoint)
    reference = dataclasses.replace(reference,
                                    torch_backend=dataclasses.replace(app.torch_backend, attention_window=window))
    if kind == "checkpoint":
        check_kernels(checkpoint, app.torch_backend)
        run = dataclasses.replace(reference, checkpoint=checkpoint)
    elif kind in ("onnx", "engine"):
        graph = model.family.backbones[0].graph
        run = dataclasses.replace(reference, backend="onnxruntime" if kind == "onnx" else "trt",
                                  files={graph: StageFile(f"variants.{name}", Path(source).expanduser())},
                                  onnx_providers=tuple(app.onnx_providers))
    else:
        run = reference
    return Variant(kind, source, run, cache)


def _variant_kind(model: Model, name: str, source: str | None, geometry) -> str:
    """What a variant's source is: the unquantized backbone itself, a quantize.py checkpoint, an ONNX
    file or an engine; refuses anything else, and checkpoints or graphs that are cut short or were
    made from another model, before any work starts."""
    if source is None:
        return "unquantized"
    path = Path(source).expanduser()
    family = model.family
    if not path.exists():
        raise UserError(f"variants.{name}={source}: no such file or folder")
    if path.is_dir() or path.suffix == ".mto":
        if str(model.config.source).endswith(SINGLE_FILE_SUFFIXES):
            raise UserError(f"variants.{name}={source}: a checkpoint is restored into the backbones its model's "
                            f"folder describes, and model.source={model.config.source} is a single file: give the "
                            "model's diffusers folder (or hub id) as model.source")
        return "checkpoint"
    if path.suffix in (".onnx", *ENGINE_SUFFIXES) and len(family.backbones) > 1:
        raise UserError(f"variants.{name}={source} is one graph, but model={model.name} has "
                        f"{len(family.backbones)} backbones ({', '.join(family.backbone_attributes)}): give a "
                        "quantize.py checkpoint folder, which holds them all")
    if path.suffix == ".onnx":
        check_graph_file(path, f"variants.{name}", family.network(family.backbones[0].graph))
        check_graph_made_for(path, f"variants.{name}={source}", model, geometry)
        return "onnx"
    if path.suffix in ENGINE_SUFFIXES:
        return "engine"
    raise UserError(f"variants.{name}={source} is not a quantize.py checkpoint folder, a backbone .onnx file "
                    f"or a TensorRT engine ({', '.join(ENGINE_SUFFIXES)})")
