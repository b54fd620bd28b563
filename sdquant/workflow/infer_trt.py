"""infer_trt.py: images for every prompt batch on the engines (or their ONNX files, or the diffusers
modules), then warm-up and timed runs and a latency report per stage."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

import torch

from ..export import engines, onnx_graphs
from .. import parallel, report
from ..cli import stage
from ..config import CAPTURING_COMPILE_MODES, quantized_backbone, validate_infer
from ..errors import UserError
from ..families.pipeline import SamplingSettings
from ..load import compute_dtype, load_pipeline, resolve_device
from ..report import library_versions, print_summary
from ..runtime.stages import OnnxRuntimeStage, StageTimer
from .settings import Sampling, checked_checkpoint, restore_quantized_backbones, settle_sampling

# NeMo's engine keys, kept beside engines.<graph>: unet_xl names the backbone's engine whatever the
# family calls its graph; the others name the graphs of their own names.
NEMO_ENGINE_KEYS = ("unet_xl", "clip1", "clip2", "vae")


@dataclass(frozen=True)
class Batches:
    """What a process's prompt batches wrote and took: its first call (which compiles or sets up),
    and its later batches' images in the seconds from the end of that call until their last PNG
    was written (0 without a later batch)."""

    written: list[Path]
    first_call_seconds: float
    later_images: int
    later_seconds: float
    nonfinite_values: int


@dataclass(frozen=True)
class StageFile:
    """The file a stage runs from, and the config key that named it (for messages)."""

    key: str
    path: Path


def run_infer(cfg) -> dict:
    """infer_trt.py: images for this process's share of the prompt batches (all of them in one
    process; under torchrun or as one of shard.count jobs, batch i on part i mod parts, with its
    global seed and file names), then timed runs and one latency report for all the parts."""
    start = time.perf_counter()
    validate_infer(cfg)
    checkpoint_key, checkpoint = quantized_backbone(cfg)
    if checkpoint:
        sidecar = checked_checkpoint(cfg.model, checkpoint_key, checkpoint)
        if cfg.torch_backend.quantized != "fake":
            from ..runtime.torch_backend import check_format

            check_format(f"{checkpoint_key}={checkpoint}", sidecar["settings"]["quantize"]["format"],
                         cfg.torch_backend.quantized)
    sampling = settle_sampling(cfg, "modules" if cfg.backend == "torch" else "graphs", cfg.cuda_graph)
    report.require_writer(sampling.family.output, cfg.model.name)
    files = stage_files(cfg, sampling)
    if cfg.backend == "torch":
        from ..runtime.torch_backend import check_attention_length

        check_attention_length(cfg.torch_backend.quantized, cfg.torch_backend.attention,
                               sampling.family.sequence_tokens(sampling.parts, sampling.geometry),
                               sampling.family.fp8_attention_tokens)
    world = parallel.current_world()
    split = checked_split(cfg, sampling, world)
    device = parallel.rank_device(resolve_device(cfg.device), world)
    parallel.start(world, device)
    try:
        place = parallel.place_of(split, world, device)
        # Every stage runs on the current stream (TensorRT engines included), so one stream of the
        # run's own keeps the stages, the host's reads and the timing events in order; TensorRT
        # would synchronize extra on the legacy default stream.
        with torch.cuda.stream(torch.cuda.Stream(device) if device.type == "cuda" else None):
            batches, timings, images_per_run = _images_and_timings(cfg, sampling, files, device, place)
        latency = report.latency_report(timings, images_per_run, cfg.sampling.steps,
                                        [backbone.graph for backbone in sampling.family.backbones])
        # The first call compiles (torch_backend.compile) or sets engines and graphs up: its excess
        # over a timed run is what a user waits once per process and shape.
        latency["first_call_seconds"] = batches.first_call_seconds
        latency["after_first_batch"] = report.after_first_batch(batches.later_images, batches.later_seconds)
        latency["setup_seconds"] = report.setup_seconds(batches.first_call_seconds, latency["ms"]["end_to_end"])
        latency.update({"backend": cfg.backend, "device": report.device_name(device), "output": sampling.family.output,
                        "images_written": len(batches.written), "nonfinite_values": batches.nonfinite_values})
        note = None
        if cfg.backend == "torch":
            from ..runtime.attention import chosen_kernel, fallback_note

            asked = cfg.torch_backend.attention_kernel
            latency["attention_kernel_setting"] = chosen_kernel(asked, device)
            note = fallback_note(asked, device)
        # One latency per group of processes that share a sample: its writer's.
        parts = parallel.gather((latency, batches.written) if place.writes else None, world)
        latencies = [part[0] for part in parts if part]
        written = sum((part[1] for part in parts if part), [])
        if not world.is_main:
            return latency
        merged = latencies[0] if len(latencies) == 1 else report.merged_latency(latencies)
        merged.update({"versions": library_versions(), "settings": _run_settings(cfg, sampling, files)})
        out = Path(cfg.out_path).expanduser()
        if cfg.shard.count > 1:
            written.append(report.write_report(out, merged, f"latency.shard{cfg.shard.index}of{cfg.shard.count}.json"))
            merged = report.merge_shard_reports(out, cfg.shard.count) or merged
        report.print_latency(merged)
        if cfg.shard.count == 1 or "shards" in merged:
            written.append(report.write_report(out, merged))
        print_summary("inference", sorted(written), time.perf_counter() - start, notes=[note] if note else [])
        return merged
    finally:
        parallel.stop(world)


def checked_split(cfg, sampling: Sampling, world: parallel.World) -> parallel.SampleSplit:
    """parallel.* as this run can take it: the process count, the guidance halves in each backbone
    call's batch, the model's heads and tokens; no step caching or CUDA graphs (a cache hook decides
    on each process's own share, so the processes of a group could part ways; a captured graph
    would hold the group's collectives), which compile modes that capture graphs use too."""
    split = parallel.SampleSplit(cfg.parallel.cfg, cfg.parallel.ulysses)
    if split.size == 1:
        return split
    captures = cfg.torch_backend.compile and cfg.torch_backend.compile_mode in CAPTURING_COMPILE_MODES
    if sampling.cache is not None or cfg.cuda_graph or captures:
        raise UserError(f"{split.named()} runs without step caching and CUDA graphs: set sampling.cache.method=none "
                        "and cuda_graph=false, and with torch_backend.compile=true a torch_backend.compile_mode that "
                        "captures none (default or max-autotune-no-cudagraphs)")
    family, run = sampling.family, sampling.runs[0]
    batches = family.text_to_image({}, sampling.parts, None, torch.device("cpu")).stage_batches(run)
    halves = all(batches[backbone.graph] == 2 * len(run.image_prompts) for backbone in family.backbones)
    parallel.check_split(split, world, halves, sampling.parts["backbone_config"].get("num_attention_heads"),
                         family.sequence_tokens(sampling.parts, sampling.geometry), cfg.model.name)
    return split


def _run_settings(cfg, sampling: Sampling, files: dict[str, StageFile]) -> dict:
    """The settled config as the report records it: the sampling as settled, the files each stage
    ran from, not the keys that may name them."""
    settings = {**OmegaConf.to_container(cfg, resolve=True),
                "sampling": OmegaConf.to_container(sampling.block, resolve=True)}
    for key in (*NEMO_ENGINE_KEYS, "engines", "engine_dir"):
        settings.pop(key, None)
    if cfg.backend != "torch":
        settings["stage_files"] = {name: str(file.path) for name, file in files.items()}
    return settings


def stage_files(cfg, sampling: Sampling) -> dict[str, StageFile]:
    """The engine (or ONNX file) of each graph the run needs, from engines.<graph>, NeMo's keys or
    engine_dir, in that order; a cached backbone's passes lie beside its engine, as export_trt.py
    cache=... builds them. Names a key for a graph the model does not have."""
    family = sampling.family
    graphs = family.graph_names()
    backbones = [backbone.graph for backbone in family.backbones]
    if cfg.unet_xl and len(backbones) > 1:
        raise UserError(f"unet_xl={cfg.unet_xl}: model={cfg.model.name} has {len(backbones)} backbones; name each "
                        "engine as " + " ".join(f"+engines.{graph}=<file>" for graph in backbones))
    # unet_xl names the backbone's engine, whatever the family calls its graph.
    aliases = {"unet_xl": backbones[0], "clip1": "clip1", "clip2": "clip2", "vae": "vae"}
    given = {aliases[key]: StageFile(key, Path(cfg[key]).expanduser()) for key in NEMO_ENGINE_KEYS if cfg[key]}
    given.update({graph: StageFile(f"engines.{graph}", Path(path).expanduser()) for graph, path in cfg.engines.items()})
    for graph, file in given.items():
        if graph not in graphs:
            raise UserError(f"{file.key}={file.path}: model={cfg.model.name} has no {graph} graph; its graphs are "
                            f"{', '.join(graphs)} (+engines.<graph>=<file>)")
    files = {graph: given.get(graph, StageFile("engine_dir", Path(cfg.engine_dir).expanduser() / f"{graph}.plan"))
             for graph in graphs}
    for network in family.networks(sampling.cache):
        if network.name not in files:
            # A step cache's passes lie beside the engine of the backbone they run (a family whose
            # backbone has such passes has one backbone).
            backbone = files[backbones[0]]
            files[network.name] = StageFile(backbone.key, backbone.path.with_name(f"{network.name}{backbone.path.suffix}"))
    return files


def _images_and_timings(cfg, sampling: Sampling, files: dict[str, StageFile], device: torch.device,
                        place: parallel.SamplePlace) -> tuple[Batches, list, int]:
    """The images of this process's prompt batches (its group's, as one of shard.count jobs), then
    the warm-up and timed runs of its first batch once every PNG is written (so that no encoding
    competes with them)."""
    part = parallel.share_of(place.replicas, cfg.shard)
    mine = parallel.shard(sampling.runs, part, "prompt batches (prompts / sampling.batch_size)")
    with stage(f"loading the {cfg.backend} stages"):
        stages = load_stages(cfg, sampling, files, device, place)
        backbones = tuple(backbone.graph for backbone in sampling.family.backbones)
        pipeline = sampling.pipeline(parallel.split_guidance(stages, backbones, place), device)
    if cfg.backend == "trt":
        _check_engine_profiles(pipeline, sampling, [settings for _, settings in mine])
    elif cfg.backend == "onnxruntime":
        _check_engine_profiles(pipeline, sampling, [settings for _, settings in mine],
                               [name for name in pipeline.stages if sampling.family.network(name).fixed])
    engines = {name: str(file.path) for name, file in files.items()}
    with report.WRITERS[sampling.family.output](Path(cfg.out_path).expanduser(), engines, cfg.backend) as writer:
        batches = _prompt_batches(pipeline, mine, len(sampling.runs), writer if place.writes else None, device)
    first = mine[0][1]
    with stage("the warm-up and timed runs"):
        for _ in range(cfg.num_warmup_runs):
            pipeline(first, StageTimer(device), progress=False)
        timings = []
        for _ in range(cfg.num_timed_runs):
            timer = StageTimer(device)
            run_start = time.perf_counter()
            pipeline(first, timer, progress=False)
            stage_seconds = timer.finish()
            timings.append((time.perf_counter() - run_start, stage_seconds))
    return batches, timings, len(first.image_prompts)


def _prompt_batches(pipeline, mine: list, total: int, writer: report.ImageWriter | None,
                    device: torch.device) -> Batches:
    """Each of `mine` (index, settings) through the pipeline, its images queued on `writer` (None:
    another process of its group writes them)."""

    def run(index: int, settings) -> int:
        with stage(f"prompt batch {index + 1} of {total}"):
            images = pipeline(settings, StageTimer(device))
            if writer is not None:
                writer.submit(images, index, settings)
            return len(images)

    start = time.perf_counter()
    run(*mine[0])
    first_call_end = time.perf_counter()
    later_images = sum(run(index, settings) for index, settings in mine[1:])
    with stage("writing the last images"):
        written = writer.finish() if writer is not None else []
    later_seconds = time.perf_counter() - first_call_end if later_images else 0.0
    return Batches(written, first_call_end - start, later_images, later_seconds,
                   writer.nonfinite_values if writer is not None else 0)


def _onnx_file(file: StageFile) -> Path:
    """The ONNX file backend=onnxruntime runs for a stage: the file itself where the key names an
    .onnx file, else the graph export_trt.py wrote for that engine (<out_path>/onnx/<name>/model.onnx
    beside <out_path>/plan/<name>.plan)."""
    if file.path.suffix == ".onnx":
        if not file.path.is_file():
            raise UserError(f"{file.key}={file.path}: no such ONNX file; give an .onnx file or the engine path of an "
                            "export_trt.py output folder")
        return file.path
    onnx_file = onnx_graphs.onnx_path(file.path.parent.parent, file.path.stem)
    if not onnx_file.is_file():
        raise UserError(f"{file.key}={file.path}: backend=onnxruntime runs the ONNX graph export_trt.py writes beside "
                        f"that engine, {onnx_file}, which does not exist: export it (export_trt.py "
                        "run_trt_export=false), or give the .onnx file itself")
    return onnx_file


def load_stages(cfg, sampling: Sampling, files: dict[str, StageFile], device: torch.device,
                place: parallel.SamplePlace | None = None) -> dict:
    family = sampling.family
    if cfg.backend == "onnxruntime":
        stages = {}
        for name, file in files.items():
            onnx_file = _onnx_file(file)
            stages[name] = OnnxRuntimeStage(onnx_file, list(cfg.onnx_providers), file.key, family.network(name),
                                            None if onnx_file == file.path else file.path)
        return stages
    if cfg.backend == "torch":
        return _torch_stages(cfg, sampling, device, place)
    from ..runtime.trt_stages import trt_stages

    for name, file in files.items():
        if not file.path.is_file():
            how = (f"export_trt.py cache.method={cfg.sampling.cache.method} cache.branch={cfg.sampling.cache.branch}"
                   if name in family.cached_graphs() else "export_trt.py")
            raise UserError(f"{file.key}={file.path}: no such engine; build it with {how}")
    flavours = {name: engines.engine_flavour(file.path) for name, file in files.items()}
    replayed = family.backbone_graphs() if cfg.cuda_graph else ()
    return trt_stages(flavours, {name: file.path for name, file in files.items()}, replayed)


def _torch_stages(cfg, sampling: Sampling, device: torch.device, place: parallel.SamplePlace | None) -> dict:
    """The diffusers modules as stages, the backbone restored from quantized_backbone where set,
    split by sequence where `place`'s group does so, with the torch backend's settings (compile,
    CUDA graphs, 8-bit kernels) applied."""
    from ..runtime import torch_backend

    family = sampling.family
    dtype = compute_dtype(device, gpu_dtype=family.gpu_dtype)
    pipe = load_pipeline(cfg.model, device, dtype)
    backbones = family.backbone_modules(pipe)
    checkpoint_key, checkpoint = quantized_backbone(cfg)
    if checkpoint:
        record = restore_quantized_backbones(cfg.model, checkpoint_key, checkpoint, backbones)
        for backbone in backbones.values():
            backbone.to(device=device, dtype=dtype)
            if cfg.torch_backend.quantized != "fake":
                torch_backend.convert_quantized(backbone, family, f"{checkpoint_key}={checkpoint}",
                                                cfg.torch_backend.quantized, cfg.torch_backend.attention,
                                                record["settings"]["quantize"]["quant_level"],
                                                family.sequence_tokens(sampling.parts, sampling.geometry))
    if place is not None:
        parallel.split_by_sequence(backbones.values(), place, cfg.parallel.ulysses)
    stages = family.torch_stages(pipe, dtype, sampling.cache)
    return torch_backend.speed_up(pipe, family, stages, cfg.torch_backend, cfg.cuda_graph, quantized=bool(checkpoint))


def _check_engine_profiles(pipeline, sampling: Sampling, runs: list[SamplingSettings],
                           stages: list[str] | None = None) -> None:
    """Refuses, before any image work, a prompt batch or size the engines' profiles (or the ONNX
    graphs' fixed shapes) of `stages` (default: every stage) cannot take."""
    from ..runtime.trt_stages import check_within_profiles

    names = list(pipeline.stages) if stages is None else stages
    profiles = {name: pipeline.stages[name].profiles() for name in names}
    networks = {name: sampling.family.network(name) for name in names}
    for settings in runs:
        batches = {name: batch for name, batch in pipeline.stage_batches(settings).items() if name in names}
        check_within_profiles(profiles, batches, pipeline.axis_sizes(settings), networks)
