"""The pipeline built once from a settled run, then called per request: every stage loaded (engines,
ONNX files, or the diffusers modules with a checkpoint restored, LoRAs fused, 8-bit kernels swapped
in, compiled and replayed as CUDA graphs), the family's data flow over them, and a call that draws
one request's images or videos with its latency per stage. infer_trt.py, evaluate.py, the Python
API (sdquant.api) and the benchmarks' rows of ours build it here; closing it releases what it held.
"""

from __future__ import annotations

import copy
import gc
import time
from dataclasses import dataclass, field

import torch

from . import parallel, report
from .cli import stage
from .errors import UserError
from .families.pipeline import SamplingSettings, make_scheduler
from .load import compute_dtype, empty_backbones, load_pipeline, resolve_device
from .runs.infer import PipelineRun
from .runs.model import Checkpoint, Model
from .runs.sample import settle_call
from .runtime.stages import OnnxRuntimeStage, StageTimer


@dataclass(frozen=True)
class Drawn:
    """What one call drew: its samples in [0, 1] (images N x 3 x H x W, videos N x F x 3 x H x W,
    float32, on the pipeline's device), the seconds from its start until they were ready, each
    stage's seconds per call, the settings it ran, and under a cache hook (the torch backend's
    sampling.cache first_block or taylorseer*) each backbone's hooked calls (one per cache context:
    Wan's guidance halves are two a step), how many of them ran in full, and how many at each of its
    steps (`full_steps`, from the backbone's first call)."""

    samples: torch.Tensor | None
    seconds: float
    stage_seconds: dict[str, list[float]]
    settings: SamplingSettings
    cache_passes: dict[str, dict] = field(default_factory=dict)


class Pipeline:
    """A model's pipeline, loaded, converted and warm, called once per request (`pipe(prompts,
    seed=..., steps=...)`, or `run(settings)` with settings already settled). The first call at a
    new shape compiles where the torch backend compiles; later calls at that shape reuse it."""

    def __init__(self, run: PipelineRun, device: torch.device, place: parallel.SamplePlace, stages: dict,
                 modules: dict, overlays: dict, dtype: torch.dtype):
        self.run_settings = run
        self.device = device
        self.place = place
        self.stages = stages
        # The backbone modules by attribute (the torch backend's), and the backbone stages each step
        # cache runs on top of the others, built on first use (the run's own at assembly).
        self.modules = modules
        self.overlays = overlays
        self.dtype = dtype
        self.cache_key = _cache_key(run.cache)
        # What a call's settings take where the caller gives none (sdquant.api: the config's sampling.*).
        self.defaults: dict = {}
        # What the torch backend's conversion to 8-bit kernels turned, by backbone attribute.
        self.conversions: dict = {}
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        family = run.family
        scheduler = make_scheduler(run.scheduler or family.default_scheduler, run.model.parts["scheduler_config"])
        self.flow = family.text_to_image({**stages, **overlays.get(self.cache_key, {})}, run.model.parts, scheduler,
                                         device)

    @property
    def family(self):
        return self.run_settings.family

    def settle(self, prompts, **asked) -> SamplingSettings:
        """One call's settings from the caller's values (sdquant.runs.sample.CALL_DEFAULTS' names;
        an absent or None one the pipeline's default, else the model's own), checked against the
        model and what this pipeline runs."""
        if isinstance(prompts, str):
            prompts = [prompts]
        given = {key: value for key, value in asked.items() if value is not None}
        settings = settle_call(self.run_settings.model, prompts, **{**self.defaults, **given})
        self.check(settings)
        return settings

    def check(self, settings: SamplingSettings, key: str = "cache") -> None:
        """Refuses a call this pipeline cannot run, before any work: a step cache its stages cannot
        take (a hook on a graph or under a captured CUDA graph; another than its graphs were built for;
        any, where processes share each sample), guidance halves a cfg split cannot find, a batch or
        size past the engines' profiles (or the ONNX graphs' fixed shapes)."""
        from .runs.infer import check_cache_runs, check_split

        if self.flow is None:
            raise UserError("this pipeline was closed, which released what it held: load it again")
        run = self.run_settings
        check_cache_runs(settings.cache, key, run.backend, run.cuda_graph)
        check_split(run.split, run.torch_backend, run.cuda_graph, run.model, settings)
        if run.backend != "torch" and _cache_key(settings.cache) not in (None, self.cache_key):
            built = run.cache.describe() if run.cache is not None else "none"
            raise UserError(f"{key}: backend={run.backend} runs the step cache its graphs were built for ({built}) or "
                            "none: build the engines for this one (export_trt.py cache.*), or run backend=torch")
        if run.backend == "torch":
            return
        from .runtime.trt_stages import check_within_profiles

        family = self.family
        # The engines' profiles, and the ONNX graphs' fixed shapes (a shared pipeline's other stages
        # are the reference's modules, which take any shape).
        names = [name for name, each in self.flow.stages.items()
                 if hasattr(each, "profiles") and (run.backend == "trt" or family.network(name).fixed)]
        profiles = {name: self.flow.stages[name].profiles() for name in names}
        networks = {name: family.network(name) for name in names}
        batches = {name: batch for name, batch in self.flow.stage_batches(settings).items() if name in names}
        check_within_profiles(profiles, batches, self.flow.axis_sizes(settings), networks)

    def __call__(self, prompts, **asked) -> Drawn:
        """Draws `prompts` (one, or a list) with the settings `asked` (seed, steps, guidance_scale,
        height, width, num_frames, num_images_per_prompt, negative_prompt, cache, ...)."""
        return self.run(self.settle(prompts, **asked), progress=False)

    def run(self, settings: SamplingSettings, progress: bool = True, latents: torch.Tensor | None = None) -> Drawn:
        """One call of settled `settings`; `latents`: the initial noise, else drawn from its seeds."""
        if self.flow is None:
            raise UserError("this pipeline was closed, which released what it held: load it again")
        self.use_cache(settings.cache)
        timer = StageTimer(self.device)
        passes_before = self._cache_passes()
        start = time.perf_counter()
        if self.stream is None:
            samples = self.flow(settings, timer, progress=progress, latents=latents)
            return self._drawn(samples, start, timer, settings, passes_before)
        # The stages run on a stream of the pipeline's own (TensorRT would synchronize extra on the
        # legacy default stream), after what the caller queued (its latents) and before what it
        # queues next on its samples.
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            samples = self.flow(settings, timer, progress=progress, latents=latents)
        caller.wait_stream(self.stream)
        samples.record_stream(caller)
        return self._drawn(samples, start, timer, settings, passes_before)

    def _cache_passes(self) -> dict[str, tuple[int, int, tuple[int, ...]]]:
        """Each hooked backbone stage's (full passes, calls, full passes at each step) so far."""
        counted = {name: getattr(each, "passes", None) for name, each in self.flow.stages.items()}
        return {name: (passes.full, passes.calls, tuple(passes.full_at)) for name, passes in counted.items()
                if passes is not None}

    def _drawn(self, samples: torch.Tensor, start: float, timer: StageTimer, settings: SamplingSettings,
               passes_before: dict[str, tuple[int, int, tuple[int, ...]]]) -> Drawn:
        """The call's record, its seconds once the device has finished it (the timer waits for it)."""
        stage_seconds = timer.finish()
        passes = {name: {"full_passes": full - passes_before[name][0], "calls": calls - passes_before[name][1],
                         "full_steps": report.steps_added(full_at, [-n for n in passes_before[name][2]])}
                  for name, (full, calls, full_at) in self._cache_passes().items()}
        return Drawn(samples, time.perf_counter() - start, stage_seconds, settings, passes)

    def use_cache(self, cache) -> None:
        """Puts the backbone stages of step cache `cache` under the data flow: those built at assembly,
        or (the torch backend) built now, once, with the other stages' speed settings."""
        key = _cache_key(cache)
        if key == self.cache_key:
            return
        family = self.family
        for module in self.modules.values():
            family.release_cache(module)
        if key not in self.overlays:
            from .runtime import torch_backend

            built = family.cache_stages(self.modules, self.dtype, cache) if cache is not None else {}
            self.overlays[key] = torch_backend.fast_stages(family, built, self.run_settings.torch_backend,
                                                           self.run_settings.cuda_graph, self.device)
        else:
            for overlay in self.overlays[key].values():
                if hasattr(overlay, "enable"):
                    overlay.enable()
        self.flow.stages = {**self.stages, **self.overlays[key]}
        self.cache_key = key

    def close(self) -> None:
        """Releases the stages, modules and device memory it held; it cannot be called after."""
        for module in self.modules.values():
            self.family.release_cache(module)
        self.stages, self.modules, self.overlays = {}, {}, {}
        self.flow = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _cache_key(cache):
    """What tells step caches apart for the stages they run on (None: no cache)."""
    return None if cache is None else cache.stages_key


def assemble(run: PipelineRun, pipe=None, shared: Pipeline | None = None) -> Pipeline:
    """The pipeline `run` describes, built once. `pipe`: a diffusers pipeline already in memory (a
    benchmark's full-size architecture) instead of the model's folder; `shared`: a pipeline whose
    stages this one shares but for the backbones (evaluate.py's variants), which it loads alone."""
    world = parallel.current_world()
    device = parallel.rank_device(resolve_device(run.device), world)
    parallel.start(world, device)
    place = parallel.place_of(run.split, world, device)
    family = run.family
    dtype = compute_dtype(device, run.dtype, family.gpu_dtype)
    with stage(f"loading the {run.backend} stages"):
        if run.backend == "torch":
            stages, modules, overlay, conversions = _torch_stages(run, device, dtype, place, pipe, shared)
        else:
            stages, modules, overlay, conversions = _graph_stages(run, shared), {}, {}, {}
    backbones = family.backbone_graphs()
    stages = parallel.split_guidance(stages, backbones, place)
    overlay = parallel.split_guidance(overlay, backbones, place)
    pipeline = Pipeline(run, device, place, stages, modules, {_cache_key(run.cache): overlay}, dtype)
    pipeline.conversions = conversions
    return pipeline


def _graph_stages(run: PipelineRun, shared: Pipeline | None) -> dict:
    """The engines (backend=trt) or ONNX files (backend=onnxruntime) of the run's files, by graph;
    with `shared`, its stages for the graphs the run has no file for."""
    family = run.family
    if run.backend == "onnxruntime":
        stages = {name: OnnxRuntimeStage(file.path, list(run.onnx_providers), file.key, family.network(name),
                                         file.given) for name, file in run.files.items()}
    else:
        from .export.engines import engine_flavour
        from .runtime.trt_stages import trt_stages

        replayed = family.backbone_graphs() if run.cuda_graph else ()
        stages = trt_stages({name: engine_flavour(file.path) for name, file in run.files.items()},
                            {name: file.path for name, file in run.files.items()}, replayed)
    return {**(shared.stages if shared is not None else {}), **stages}


def _torch_stages(run: PipelineRun, device: torch.device, dtype: torch.dtype, place: parallel.SamplePlace, pipe,
                  shared: Pipeline | None) -> tuple[dict, dict, dict, dict]:
    """The diffusers modules as stages, the backbones restored from the run's checkpoint where it has
    one and turned into its format's kernels, split by sequence where the group does so, at the
    torch backend's speed settings; also the backbone modules, the backbone stages of the run's step
    cache (those the other stages are overlaid with) and what each backbone's conversion to 8-bit
    kernels turned (by attribute)."""
    from .runtime import torch_backend

    family, config = run.family, run.model.config
    shares_backbones = shared is not None and runs_shared_backbones(run, shared)
    if shares_backbones:
        modules = dict(shared.modules)
    elif shared is not None:
        modules = (restored_backbones(run.model, run.checkpoint) if run.checkpoint
                   else {attribute: copy.deepcopy(module) for attribute, module in shared.modules.items()})
    elif pipe is not None:
        modules = family.backbone_modules(pipe)
    elif run.checkpoint is not None and (empty := empty_backbones(config)) is not None:
        # The checkpoint holds every backbone weight: the backbones are built empty and take them.
        pipe = load_pipeline(config, device, dtype, backbones=empty)
        modules = family.backbone_modules(pipe)
        restore(run.checkpoint, modules)
        pipe.to(device)
    else:
        pipe = load_pipeline(config, device, dtype)
        modules = family.backbone_modules(pipe)
        if run.checkpoint is not None:
            restore(run.checkpoint, modules)
    conversions = {}
    if run.checkpoint is not None:
        for attribute, module in modules.items():
            module.to(device=device, dtype=dtype)
            if run.torch_backend.quantized != "fake":
                conversions[attribute] = torch_backend.convert_quantized(
                    module, family, run.checkpoint.named, run.torch_backend.quantized, run.torch_backend.attention,
                    run.checkpoint.quant_level)
    parallel.split_by_sequence(modules.values(), place, run.split.ulysses)
    block, quantized = run.torch_backend, run.checkpoint is not None
    # The run's step cache first: a hook on a module keeps it in the forms a hook compiles in.
    built = family.cache_stages(modules, dtype, run.cache) if run.cache is not None else {}
    if shared is None:
        stages = torch_backend.speed_up(pipe, family, family.torch_stages(pipe, dtype), block, run.cuda_graph,
                                        quantized)
    elif shares_backbones:
        stages = dict(shared.stages)
    else:
        # The reference's text encoders and decoder; not its backbones, nor stages made of them (its
        # precomputed AdaLN modulations).
        stages = {name: each for name, each in shared.stages.items()
                  if name in family.graph_names() and name not in family.backbone_graphs()}
        stages.update(torch_backend.speed_up_backbones(family, modules, family.backbone_stages(modules, dtype), block,
                                                       run.cuda_graph, device, quantized))
    return stages, modules, torch_backend.fast_stages(family, built, block, run.cuda_graph, device), conversions


def runs_shared_backbones(run: PipelineRun, shared: Pipeline) -> bool:
    """Whether `run` draws with `shared`'s own backbones: no checkpoint of its own, and their
    attention run as `shared` runs it."""
    return (run.checkpoint is None
            and run.torch_backend.attention_window == shared.run_settings.torch_backend.attention_window)


def restore(checkpoint: Checkpoint, modules: dict) -> None:
    """Loads the quantize.py checkpoint into `modules` (the backbones, by attribute)."""
    from .quantize import checkpoint as checkpoints

    for attribute, module in modules.items():
        restored = checkpoints.restore(module, checkpoint.folder, attribute)
        if any(t.is_meta for t in (*restored.parameters(), *restored.buffers())):
            raise UserError(f"{checkpoint.named} does not hold every weight of the {attribute}: quantize the model "
                            "again")


def restored_backbones(model: Model, checkpoint: Checkpoint) -> dict:
    """The model's backbones (by attribute) built on the meta device and restored from `checkpoint`,
    which brings every weight."""
    modules = empty_backbones(model.config)
    restore(checkpoint, modules)
    return modules
