"""evaluate.py: each variant's images and teacher-forced noise predictions against the model's own
unquantized backbone's, from identical initial latents."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from omegaconf import OmegaConf

import torch

from ..export import engines
from .. import parallel, report
from ..quality import scoring
from ..export.onnx_graphs import check_graph_file
from ..families import family_of
from ..cli import stage
from ..config import validate_evaluate
from ..errors import UserError
from ..load import SINGLE_FILE_SUFFIXES, compute_dtype, empty_backbones, load_pipeline, resolve_device
from ..progress import Progress
from ..report import library_versions, print_summary
from ..runtime.stages import OnnxRuntimeStage, StageTimer
from .settings import Sampling, checked_cache, checked_checkpoint, restore_quantized_backbones, settle_sampling


def run_evaluate(cfg) -> dict:
    """evaluate.py: each variant's images and teacher-forced noise predictions against the unquantized
    backbone's."""
    start = time.perf_counter()
    validate_evaluate(cfg)
    kinds = {name: _variant_kind(cfg.model, name, source) for name, source in cfg.variants.items()}
    # The reference is the uncached, unquantized backbone whatever the variants cache: the sampling
    # cache is each variant's, checked for what that variant runs on.
    sampling = settle_sampling(cfg)
    caches = {}
    for name, kind in kinds.items():
        key = f"variant_cache.{name}" if name in cfg.variant_cache else "sampling.cache"
        caches[name] = checked_cache(OmegaConf.select(cfg, key), key, cfg.model, sampling.parts,
                                     "modules" if kind in ("unquantized", "checkpoint") else "one file")
    if "checkpoint" in kinds.values():
        from ..runtime.torch_backend import check_attention_length

        check_attention_length(cfg.torch_backend.quantized, cfg.torch_backend.attention,
                               sampling.family.sequence_tokens(sampling.parts, sampling.geometry),
                               sampling.family.fp8_attention_tokens)
    runs = [dataclasses.replace(settings, cache=None) for settings in sampling.runs]
    world = parallel.current_world()
    device = parallel.rank_device(resolve_device(cfg.device), world)
    parallel.start(world, device)
    try:
        part = parallel.share_of(world, cfg.shard)
        mine = parallel.shard(runs, part, "prompt batches (prompts / sampling.batch_size)")
        batches, sources, notes, dtype = _part_results(cfg, sampling, kinds, caches, mine, device)
        batches = {index: batch for each in parallel.gather(batches, world) for index, batch in each.items()}
        if not world.is_main:
            return {}
        out = Path(cfg.out_path).expanduser()
        if cfg.shard.count > 1:
            batches = _with_other_shards(out, cfg.shard, batches)
            if batches is None:
                print(f"shard {cfg.shard.index} of {cfg.shard.count} done; the last shard to finish writes the report")
                return {}
        scores, reference_clip, reference_adherence, columns = _merged(batches, sources)
        settings = {"model": cfg.model.name, "sampling": OmegaConf.to_container(sampling.block, resolve=True),
                    "device": report.device_name(device), "dtype": str(dtype), "versions": library_versions(),
                    "processes": part.size}
        result = scoring.build_report(scores, reference_clip, reference_adherence, notes, settings,
                                      scoring.reference_name(dtype))
        with stage("writing the report"):
            written = scoring.write_outputs(out, result, scoring.image_grid(columns))
        scoring.print_means(result)
        print_summary("quality evaluation", written, time.perf_counter() - start)
        return result
    finally:
        parallel.stop(world)


def _part_results(cfg, sampling: Sampling, kinds: dict, caches: dict, mine: list[tuple[int, object]],
                  device: torch.device) -> tuple[dict, dict, list, torch.dtype]:
    """This process's prompt batches, each as a record of the reference's and every variant's
    images and scores (so that parts merge in the run's batch order); also each variant's source,
    the metrics' notes and the dtype."""
    from ..runtime.torch_backend import decode_in_slices

    family = sampling.family
    dtype = compute_dtype(device, cfg.dtype, family.gpu_dtype)
    with stage("loading the model"):
        pipe = load_pipeline(cfg.model, device, dtype)
        stages = decode_in_slices(family, family.torch_stages(pipe, dtype), cfg.torch_backend.vae_batch)
        pipeline = sampling.pipeline(stages, device)
        lpips, clip = (scoring.lpips_metric(cfg.metrics.lpips_net, device),
                       scoring.clip_metric(cfg.metrics.clip_model, device))
    reference_backbones = {graph: pipeline.stages[graph] for graph in pipeline.backbones}
    with stage("the unquantized reference runs"):
        references = _reference_runs(pipeline, [settings for _, settings in mine], device,
                                     scoring.reference_name(dtype))
    scores = scoring.SCORES[family.output]
    batches = {}
    for (index, _), (settings, _, images, _) in zip(mine, references):
        batches[index] = {"reference": {
            "images": scores.cells(images).cpu(), "adherence": scores.adherence(images, settings.image_prompts),
            "clip": clip.score(None, scores.cells(images), settings.image_prompts) if clip.score else None},
            "variants": {}}
    sources = {}
    for name, kind in kinds.items():
        with stage(f"the runs of variant {name}"):
            backbones, modules = _variant_backbones(cfg, name, kind, reference_backbones,
                                                    family.backbone_modules(pipe), device, dtype,
                                                    family.sequence_tokens(sampling.parts, sampling.geometry))
            if caches[name] is not None:
                cached = family.cache_stages(modules, dtype, caches[name])
                # A cache hook runs the backbone's own stage under it; DeepCache adds its passes.
                backbones.update({graph: cached.pop(graph) for graph in list(cached) if graph in backbones})
                pipeline.stages.update(cached)
            source = str(cfg.variants[name] or "the unquantized backbone again (self-check)")
            sources[name] = source if caches[name] is None else f"{source}, cached ({caches[name].describe()})"
            runs = _variant_runs(pipeline, name, backbones, caches[name], references, [lpips, clip], scores, device)
            for module in modules.values():
                family.release_cache(module)
            for (index, _), batch in zip(mine, runs):
                batches[index]["variants"][name] = batch
    return batches, sources, [m.note for m in (lpips, clip) if m.note], dtype


def _with_other_shards(out: Path, shard, batches: dict) -> dict | None:
    """All shard jobs' batch records once every job has saved its own (this one's now), else None."""
    from ..artifacts import atomic_path

    folder = out / "shards"
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(folder / f"part{shard.index}of{shard.count}.pt") as staging:
        torch.save(batches, staging)
    files = [folder / f"part{index}of{shard.count}.pt" for index in range(shard.count)]
    if not all(path.is_file() for path in files):
        return None
    return {index: batch for path in files for index, batch in torch.load(path, weights_only=False).items()}


def _merged(batches: dict, sources: dict) -> tuple[dict, list | None, list, list]:
    """The batch records in the run's order, as the report takes them: each variant's scores, the
    reference's CLIP scores and adherence, and the grid's columns."""
    ordered = [batches[index] for index in sorted(batches)]
    scores = {name: scoring.VariantScores(source=source) for name, source in sources.items()}
    for batch in ordered:
        for name, variant in batch["variants"].items():
            scores[name].per_prompt += variant["per_prompt"]
            scores[name].step_errors.append(variant["step_errors"])
            scores[name].step_graphs = variant["step_graphs"]
            scores[name].adherence += variant["adherence"]
    clip = [value for batch in ordered for value in batch["reference"]["clip"]] \
        if ordered[0]["reference"]["clip"] is not None else None
    adherence = [row for batch in ordered for row in batch["reference"]["adherence"]]
    columns = [torch.cat([batch["reference"]["images"] for batch in ordered])]
    columns += [torch.cat([batch["variants"][name]["images"] for batch in ordered]) for name in sources]
    return scores, clip, adherence, columns


def _reference_runs(pipeline, runs: list, device: torch.device, name: str) -> list[tuple]:
    """Per pipeline call: its settings, initial latents, the unquantized backbones' images and their
    recorded calls, in the order they ran."""
    reference_backbones = {graph: pipeline.stages[graph] for graph in pipeline.backbones}
    references = []
    for settings in Progress(runs, name, "prompt batches"):
        latents = pipeline.initial_latents(settings)
        calls = []
        pipeline.stages.update({graph: scoring.RecordingStage(stage, graph, calls)
                                for graph, stage in reference_backbones.items()})
        references.append((settings, latents, pipeline(settings, StageTimer(device), latents=latents), calls))
    pipeline.stages.update(reference_backbones)
    return references


def _variant_runs(pipeline, name: str, backbones: dict, cache, references: list[tuple], metrics: list, scores,
                  device: torch.device) -> list[dict]:
    """Per reference run, one variant's images and scores from the same initial latents; with a
    step cache (whose stages the pipeline holds), teacher forcing runs the cached passes too."""
    pipeline.stages.update(backbones)
    batches = []
    for settings, latents, reference, calls in Progress(references, name, "prompt batches"):
        settings = dataclasses.replace(settings, cache=cache)
        images = pipeline(settings, StageTimer(device), latents=latents)
        batches.append({
            "images": scores.cells(images).cpu(), "adherence": scores.adherence(images, settings.image_prompts),
            "per_prompt": scores.score(reference, images, settings.image_prompts, metrics),
            "step_errors": scoring.teacher_forced_errors(
                calls, lambda step, inputs: pipeline.predict(settings, step, inputs, StageTimer(device))),
            "step_graphs": [graph for graph, _, _ in calls]})
    return batches


ENGINE_SUFFIXES = (".plan", ".engine")


def _variant_kind(model, name: str, source: str | None) -> str:
    """What a variant's source is: the unquantized backbone itself, a quantize.py checkpoint, an ONNX file
    or an engine; refuses anything else, and checkpoints or graphs that are cut short or were made
    from another model, before any work starts."""
    if source is None:
        return "unquantized"
    path = Path(source).expanduser()
    if not path.exists():
        raise UserError(f"variants.{name}={source}: no such file or folder")
    if path.is_dir() or path.suffix == ".mto":
        checked_checkpoint(model, f"variants.{name}", source)
        if str(model.source).endswith(SINGLE_FILE_SUFFIXES):
            raise UserError(f"variants.{name}={source}: a checkpoint is restored into the backbones its model's "
                            f"folder describes, and model.source={model.source} is a single file: give the model's "
                            "diffusers folder (or hub id) as model.source")
        return "checkpoint"
    if path.suffix in (".onnx", *ENGINE_SUFFIXES):
        family = family_of(model.family)
        if len(family.backbones) > 1:
            raise UserError(f"variants.{name}={source} is one graph, but model={model.name} has "
                            f"{len(family.backbones)} backbones ({', '.join(family.backbone_attributes)}): give a "
                            "quantize.py checkpoint folder, which holds them all")
    if path.suffix == ".onnx":
        family = family_of(model.family)
        check_graph_file(path, f"variants.{name}", family.network(family.backbones[0].graph))
        return "onnx"
    if path.suffix in ENGINE_SUFFIXES:
        return "engine"
    raise UserError(f"variants.{name}={source} is not a quantize.py checkpoint folder, a backbone .onnx file "
                    f"or a TensorRT engine ({', '.join(ENGINE_SUFFIXES)})")


def _variant_backbones(cfg, name: str, kind: str, reference_backbones: dict, reference_modules: dict,
                       device: torch.device, dtype: torch.dtype, tokens: int | None) -> tuple[dict, dict]:
    """The backbone stages a variant runs, by graph, and its modules, by attribute, where it runs
    modules (for a step cache); `tokens`: what each backbone call attends over, where known."""
    source = cfg.variants[name]
    family = family_of(cfg.model.family)
    if kind == "unquantized":
        return dict(reference_backbones), reference_modules
    if kind in ("onnx", "engine"):
        # One graph: a family of one backbone (_variant_kind refuses a file for several).
        (graph,) = reference_backbones
        file = Path(source).expanduser()
        if kind == "onnx":
            return {graph: OnnxRuntimeStage(file, list(cfg.onnx_providers), f"variants.{name}",
                                            family.network(graph))}, {}
        from ..runtime.trt_stages import trt_stages

        return {graph: trt_stages(engines.engine_flavour(file), {graph: file}, ())[graph]}, {}
    modules = empty_backbones(cfg.model)
    record = restore_quantized_backbones(cfg.model, f"variants.{name}", source, modules)
    kernels = cfg.torch_backend
    for module in modules.values():
        module.to(device=device, dtype=dtype)
        if kernels.quantized != "fake":
            from ..runtime import torch_backend

            torch_backend.convert_quantized(module, family, f"variants.{name}={source}", kernels.quantized,
                                            kernels.attention, record["settings"]["quantize"]["quant_level"], tokens)
    return family.backbone_stages(modules, dtype), modules
