"""infer_trt.py's config settled: what the assembler builds once (a PipelineRun: the model, the
backend with its files or kernels, the checkpoint) and what the script draws with it (the prompt
batches, where the images go, the timing the user asked for)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import parallel, report
from ..config import (CAPTURING_COMPILE_MODES, InferApp, ShardBlock, TorchBackendBlock, quantized_backbone,
                      settled_config, validate_infer)
from ..errors import UserError
from ..export import onnx_graphs
from ..runtime.attention_window import check_attention_window
from .model import Checkpoint, Model, check_graph_made_for, settle_checkpoint, settle_model
from ..families.pipeline import SamplingSettings
from .sample import Sampling, settle_defaults, settle_sampling

BACKENDS = ("trt", "onnxruntime", "torch")
# NeMo's engine keys, kept beside engines.<graph>: unet_xl names the backbone's engine whatever the
# family calls its graph; the others name the graphs of their own names.
NEMO_ENGINE_KEYS = ("unet_xl", "clip1", "clip2", "vae")


@dataclass(frozen=True)
class StageFile:
    """The file a stage runs from (an engine, or the ONNX file backend=onnxruntime runs), and the
    config key that named it (for messages); `given`: what the key named where the ONNX file was
    found beside it (an engine's graph)."""

    key: str
    path: Path
    given: Path | None = None


@dataclass(frozen=True)
class PipelineRun:
    """What the assembler (sdquant.assembly) builds once: the model, the backend and each graph's
    file (engines, ONNX files) or the torch backend's settings and the checkpoint it restores, the
    scheduler, the step cache the stages are first built for, and how the processes of one sample
    share it."""

    model: Model
    backend: str = "torch"
    device: str = "auto"
    scheduler: str | None = None
    files: dict[str, StageFile] = field(default_factory=dict)
    onnx_providers: tuple[str, ...] = ("CPUExecutionProvider",)
    checkpoint: Checkpoint | None = None
    torch_backend: TorchBackendBlock = field(default_factory=TorchBackendBlock)
    cuda_graph: bool = False
    cache: object | None = None
    split: parallel.SampleSplit = parallel.SampleSplit()
    # What the modules run in: auto, the family's half precision on a GPU and fp32 on a CPU
    # (evaluate.py's dtype; sdquant.load.compute_dtype).
    dtype: str = "auto"

    @property
    def family(self):
        return self.model.family


@dataclass(frozen=True)
class InferRun:
    """infer_trt.py settled: the pipeline to build, its prompt batches, where the images and the
    latency report go, the shard of the batches this job draws and the extra timed runs asked for."""

    pipeline: PipelineRun
    sampling: Sampling
    out_path: Path
    shard: ShardBlock
    warmup_runs: int
    timed_runs: int
    record: dict


def settle_infer(cfg) -> InferRun:
    """infer_trt.py's config, every value checked before any work: the pipeline to build
    (settle_pipeline), the sampling, the writer, the share of the prompt batches, the output folder."""
    app: InferApp = settled_config(cfg)
    validate_infer(app)
    model = settle_model(app.model, drawing=True)
    sampling = settle_sampling(model, app.sampling)
    pipeline = settle_pipeline(app, model, sampling.first.cache, sampling.first.geometry)
    report.require_writer(model.family.output, model.name)
    check_split(pipeline.split, app.torch_backend, app.cuda_graph, model, sampling.first)
    check_recording(app)
    replicas = parallel.replicas_of(pipeline.split, parallel.current_world())
    parallel.shard(list(sampling.runs), parallel.share_of(replicas, app.shard),
                   "prompt batches (prompts / sampling.batch_size)")
    out_path = checked_out_path(app.out_path, "out_path")
    return InferRun(pipeline, sampling, out_path, app.shard, app.num_warmup_runs, app.num_timed_runs,
                    run_record(app, sampling, pipeline.files))


def settle_pipeline(app: InferApp, model: Model, cache, geometry) -> PipelineRun:
    """What the assembler builds for infer_trt.py's config (and the Python API's, which takes the
    same keys): the checkpoint and the kernels that run it, the step cache checked against what it
    runs on, the file of each graph, the split of each sample over processes."""
    checkpoint = checked_run_checkpoint(app, model)
    check_cache_runs(cache, "sampling.cache", app.backend, app.cuda_graph)
    check_attention_window(model, app.torch_backend.attention_window, "torch_backend.attention_window", app.backend,
                           app.torch_backend, checkpoint, app.parallel.ulysses)
    files = stage_files(app, model, cache, geometry) if app.backend != "torch" else {}
    if app.backend == "trt" and not torch.cuda.is_available():
        raise UserError("backend=trt needs a CUDA GPU: use backend=onnxruntime or backend=torch here")
    split = parallel.SampleSplit(app.parallel.cfg, app.parallel.ulysses)
    return PipelineRun(model, app.backend, app.device, app.sampling.scheduler or model.family.default_scheduler,
                       files, tuple(app.onnx_providers), checkpoint, app.torch_backend, app.cuda_graph, cache, split)


def settle_called_pipeline(app) -> PipelineRun:
    """What a settled config of infer_trt.py's keys builds to be called per request (the Python
    API's pipeline, serve.py's replicas'): every value checked, the model's folder read without
    its weights."""
    validate_infer(app)
    if app.torch_backend.attention_window.record_to:
        raise UserError("torch_backend.attention_window.record_to: infer_trt.py records the heads' shares over its "
                        "prompts; a pipeline called per request draws with heads_file")
    model = settle_model(app.model, drawing=True)
    defaults = settle_defaults(model, app.sampling)
    run = settle_pipeline(app, model, defaults.cache, defaults.geometry)
    check_split(run.split, app.torch_backend, app.cuda_graph, model, defaults)
    return run


def check_recording(app: InferApp) -> None:
    """A recording of the heads' shares draws every prompt in this one process, which writes it."""
    if not app.torch_backend.attention_window.record_to:
        return
    split = app.shard.count > 1 or app.parallel.cfg > 1 or parallel.current_world().size > 1
    if split:
        raise UserError("torch_backend.attention_window.record_to: record the heads' shares in one process (no "
                        "shard.count, parallel.cfg or torchrun), which draws every prompt")


def checked_run_checkpoint(app, model: Model) -> Checkpoint | None:
    """The checkpoint backend=torch restores, checked, and its format against the kernels asked
    for (torch_backend.quantized)."""
    key, value = quantized_backbone(app)
    if not value:
        return None
    checkpoint = settle_checkpoint(model, key, value)
    check_kernels(checkpoint, app.torch_backend)
    return checkpoint


def check_kernels(checkpoint: Checkpoint, kernels) -> None:
    """Refuses, before loading it, a checkpoint the kernels asked for (torch_backend.quantized,
    .attention) cannot run: another format's, or FP8 attention from below level 4."""
    if kernels.quantized == "fake":
        return
    from ..quantize.recipe import ATTENTION_LEVEL
    from ..runtime.torch_backend import check_format, no_attention_ranges

    check_format(checkpoint.named, checkpoint.format, kernels.quantized)
    if kernels.attention == "fp8" and float(checkpoint.quant_level) < ATTENTION_LEVEL:
        raise no_attention_ranges(checkpoint.named, checkpoint.quant_level)


def check_cache_runs(cache, key: str, backend: str, cuda_graph: bool) -> None:
    """Refuses a step cache what it would run on cannot: a diffusers hook on a graph (it is a hook on
    the module), or a hook under one captured CUDA graph (it decides on the host at each step)."""
    if cache is None or cache.exported:
        return
    if backend != "torch":
        raise UserError(f"{key}.method={cache.method} is a diffusers hook on the transformer module: run it with "
                        "backend=torch")
    if cuda_graph:
        raise UserError(f"{key}.method={cache.method} decides on the host at each step which blocks run, which one "
                        "captured CUDA graph cannot replay: set cuda_graph=false")


def checked_out_path(value: str, key: str) -> Path:
    """An output folder: refused where it is an existing file, before any work."""
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise UserError(f"{key}={value} is a file: give a folder for the outputs (it is made where missing)")
    return path


def stage_files(app, model: Model, cache, geometry) -> dict[str, StageFile]:
    """The file each graph's stage runs from, checked: the engine from engines.<graph>, NeMo's keys
    or engine_dir, in that order, or for backend=onnxruntime its ONNX file; a cached backbone's
    passes lie beside its engine, as export_trt.py cache=... builds them. Names a key for a graph
    the model does not have."""
    family = model.family
    graphs = family.graph_names()
    backbones = [backbone.graph for backbone in family.backbones]
    if app.unet_xl and len(backbones) > 1:
        raise UserError(f"unet_xl={app.unet_xl}: model={model.name} has {len(backbones)} backbones; name each "
                        "engine as " + " ".join(f"+engines.{graph}=<file>" for graph in backbones))
    aliases = {"unet_xl": backbones[0], "clip1": "clip1", "clip2": "clip2", "vae": "vae"}
    given = {aliases[key]: StageFile(key, Path(getattr(app, key)).expanduser())
             for key in NEMO_ENGINE_KEYS if getattr(app, key)}
    given.update({graph: StageFile(f"engines.{graph}", Path(path).expanduser()) for graph, path in app.engines.items()})
    for graph, file in given.items():
        if graph not in graphs:
            raise UserError(f"{file.key}={file.path}: model={model.name} has no {graph} graph; its graphs are "
                            f"{', '.join(graphs)} (+engines.<graph>=<file>)")
    files = {graph: given.get(graph, StageFile("engine_dir", Path(app.engine_dir).expanduser() / f"{graph}.plan"))
             for graph in graphs}
    for network in family.networks(cache):
        if network.name not in files:
            backbone = files[backbones[0]]
            passes = backbone.path.with_name(f"{network.name}{backbone.path.suffix}")
            files[network.name] = StageFile(backbone.key, passes)
    if app.backend == "onnxruntime":
        found = {name: onnx_file(file, family.network(name)) for name, file in files.items()}
        for name in family.backbone_graphs():
            if name in found:
                file = found[name]
                named = f"{file.key}={file.path}" if file.given is None else \
                    f"{file.key}={file.given}: its ONNX graph {file.path}"
                check_graph_made_for(file.path, named, model, geometry)
        return found
    for name, file in files.items():
        if not file.path.is_file():
            how = (f"export_trt.py cache.method={app.sampling.cache.method} cache.branch={app.sampling.cache.branch}"
                   if name in family.cached_graphs() else "export_trt.py")
            raise UserError(f"{file.key}={file.path}: no such engine; build it with {how}")
    from ..export.engines import engine_flavour

    for file in files.values():
        engine_flavour(file.path)
    return files


def onnx_file(file: StageFile, network) -> StageFile:
    """The ONNX file backend=onnxruntime runs for a stage, checked: the file itself where the key
    names an .onnx file, else the graph export_trt.py wrote for that engine
    (<out_path>/onnx/<name>/model.onnx beside <out_path>/plan/<name>.plan)."""
    if file.path.suffix == ".onnx":
        if not file.path.is_file():
            raise UserError(f"{file.key}={file.path}: no such ONNX file; give an .onnx file or the engine path of an "
                            "export_trt.py output folder")
        onnx_graphs.check_graph_file(file.path, file.key, network)
        return file
    found = onnx_graphs.onnx_path(file.path.parent.parent, file.path.stem)
    if not found.is_file():
        raise UserError(f"{file.key}={file.path}: backend=onnxruntime runs the ONNX graph export_trt.py writes beside "
                        f"that engine, {found}, which does not exist: export it (export_trt.py "
                        "run_trt_export=false), or give the .onnx file itself")
    onnx_graphs.check_graph_file(found, file.key, network, file.path)
    return StageFile(file.key, found, file.path)


def check_split(split: parallel.SampleSplit, torch_block, cuda_graph: bool, model: Model,
                settings: SamplingSettings) -> None:
    """parallel.* as a call can take it: the process count, the guidance halves in a backbone's
    calls (an expert at guidance scale 1 takes them both when they are split), the model's heads
    and tokens; no step caching or CUDA graphs (a cache hook decides on each process's own share,
    so the processes of a group could part ways; a captured graph would hold the group's
    collectives), which compile modes that capture graphs use too."""
    if split.size == 1:
        return
    captures = torch_block.compile and torch_block.compile_mode in CAPTURING_COMPILE_MODES
    if settings.cache is not None or cuda_graph or captures:
        raise UserError(f"{split.named()} runs without step caching and CUDA graphs: set sampling.cache.method=none "
                        "and cuda_graph=false, and with torch_backend.compile=true a torch_backend.compile_mode that "
                        "captures none (default or max-autotune-no-cudagraphs)")
    family = model.family
    batches = family.text_to_image({}, model.parts, None, torch.device("cpu")).stage_batches(settings)
    halves = any(batches[backbone.graph] == 2 * len(settings.image_prompts) for backbone in family.backbones)
    parallel.check_split(split, parallel.current_world(), halves,
                         model.parts["backbone_config"].get("num_attention_heads"),
                         family.sequence_tokens(model.parts, settings.geometry), model.name)


def run_record(app, sampling: Sampling, files: dict[str, StageFile]) -> dict:
    """The settled config as the latency report records it: the sampling as settled, the files each
    stage ran from, not the keys that may name them."""
    import dataclasses

    settings = {key: value for key, value in dataclasses.asdict(app).items()
                if key not in (*NEMO_ENGINE_KEYS, "engines", "engine_dir")}
    settings["sampling"] = sampling.record
    if app.backend != "torch":
        settings["stage_files"] = {name: str(file.path) for name, file in files.items()}
    return settings
