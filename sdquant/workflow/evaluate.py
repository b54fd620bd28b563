"""evaluate.py: each variant's images and teacher-forced noise predictions against the model's own
unquantized backbone's, from identical initial latents; the reference and the variants built by
the assembler (sdquant.assembly), each variant's backbones beside the reference's other stages."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from .. import parallel, report
from ..assembly import Pipeline, assemble, runs_shared_backbones
from ..quality import scoring
from ..cli import stage
from ..errors import UserError
from ..progress import Progress
from ..report import library_versions, print_summary
from ..runs.evaluate import EvaluateRun, settle_evaluate
from ..runtime.stages import StageTimer


def run_evaluate(cfg) -> dict:
    """evaluate.py at its edge: the config settled (every variant checked), then evaluated."""
    return evaluate(settle_evaluate(cfg))


def evaluate(run: EvaluateRun, built: dict[str, Pipeline] | None = None) -> dict:
    """Each variant's images and teacher-forced noise predictions against the unquantized
    backbone's, this process's share of the prompt batches (all of them in one process). `built`:
    variants whose pipeline the caller built (a peer library's quantization of the backbones, which
    no config names), drawn as given instead of assembled from their settings, and closed after."""
    stray = sorted(set(built or {}) - set(run.variants))
    if stray:
        raise UserError(f"built pipelines for {', '.join(stray)}: no such variant (variants: {', '.join(run.variants)})")
    start = time.perf_counter()
    world = parallel.current_world()
    try:
        with stage("loading the model"):
            reference = assemble(run.reference)
            metrics = (scoring.lpips_metric(run.metrics.lpips_net, reference.device),
                       scoring.clip_metric(run.metrics.clip_model, reference.device))
        part = parallel.share_of(world, run.shard)
        mine = parallel.shard(list(run.sampling.runs), part, "prompt batches (prompts / sampling.batch_size)")
        batches = _part_results(run, reference, mine, metrics, built or {})
        batches = {index: batch for each in parallel.gather(batches, world) for index, batch in each.items()}
        if not world.is_main:
            return {}
        out = run.out_path
        if run.shard.count > 1:
            batches = _with_other_shards(out, run.shard, batches)
            if batches is None:
                print(f"shard {run.shard.index} of {run.shard.count} done; the last shard to finish writes the report")
                return {}
        sources = {name: variant.describe() for name, variant in run.variants.items()}
        scores, reference_clip, reference_adherence, columns = _merged(batches, sources)
        settings = {"model": run.model.name, "sampling": run.sampling.record,
                    "device": report.device_name(reference.device), "dtype": str(reference.dtype),
                    "versions": library_versions(), "processes": part.size}
        result = scoring.build_report(scores, reference_clip, reference_adherence,
                                      [metric.note for metric in metrics if metric.note], settings,
                                      scoring.reference_name(reference.dtype))
        with stage("writing the report"):
            written = scoring.write_outputs(out, result, scoring.image_grid(columns))
        scoring.print_means(result)
        print_summary("quality evaluation", written, time.perf_counter() - start)
        return result
    finally:
        parallel.stop(world)


def _part_results(run: EvaluateRun, reference: Pipeline, mine: list[tuple[int, object]], metrics: tuple,
                  built: dict[str, Pipeline]) -> dict:
    """This process's prompt batches, each as a record of the reference's and every variant's
    images and scores (so that parts merge in the run's batch order)."""
    lpips, clip = metrics
    scores = scoring.SCORES[run.model.family.output]
    # A graph variant (an ONNX file, an engine) loads in moments: its fixed shapes or profiles are
    # checked against every batch before any run, then it is let go until its turn.
    for name, variant in run.variants.items():
        if variant.kind in ("onnx", "engine"):
            with assemble(variant.pipeline, shared=reference) as graph:
                for _, settings in mine:
                    graph.check(settings, f"variants.{name}")
    with stage("the unquantized reference runs"):
        references = _reference_runs(reference, [settings for _, settings in mine],
                                     scoring.reference_name(reference.dtype))
    batches = {}
    for (index, _), (settings, _, images, _) in zip(mine, references):
        batches[index] = {"reference": {
            "images": scores.cells(images).cpu(), "adherence": scores.adherence(images, settings.image_prompts),
            "clip": clip.score(None, scores.cells(images), settings.image_prompts) if clip.score else None},
            "variants": {}}
    for name, variant in run.variants.items():
        with stage(f"the runs of variant {name}"):
            shares = variant.kind == "unquantized" and runs_shared_backbones(variant.pipeline, reference)
            pipeline = built.get(name) or (reference if shares else assemble(variant.pipeline, shared=reference))
            runs = _variant_runs(pipeline, name, variant.cache, references, [lpips, clip], scores)
            if pipeline is reference:
                reference.use_cache(None)
            else:
                pipeline.close()
            for (index, _), batch in zip(mine, runs):
                batches[index]["variants"][name] = batch
    return batches


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


def _reference_runs(pipeline: Pipeline, runs: list, name: str) -> list[tuple]:
    """Per pipeline call: its settings, initial latents, the unquantized backbones' images and their
    recorded calls, in the order they ran."""
    stages = pipeline.flow.stages
    backbones = {graph: stages[graph] for graph in pipeline.flow.backbones}
    references = []
    for settings in Progress(runs, name, "prompt batches"):
        latents = pipeline.flow.initial_latents(settings)
        calls = []
        stages.update({graph: scoring.RecordingStage(stage_, graph, calls) for graph, stage_ in backbones.items()})
        references.append((settings, latents, pipeline.run(settings, latents=latents).samples, calls))
    stages.update(backbones)
    return references


def _variant_runs(pipeline: Pipeline, name: str, cache, references: list[tuple], metrics: list, scores) -> list[dict]:
    """Per reference run, one variant's images and scores from the same initial latents; with a
    step cache, teacher forcing runs the cached passes too."""
    batches = []
    for settings, latents, reference, calls in Progress(references, name, "prompt batches"):
        settings = dataclasses.replace(settings, cache=cache)
        images = pipeline.run(settings, latents=latents).samples
        batches.append({
            "images": scores.cells(images).cpu(), "adherence": scores.adherence(images, settings.image_prompts),
            "per_prompt": scores.score(reference, images, settings.image_prompts, metrics),
            "step_errors": scoring.teacher_forced_errors(
                calls, lambda step, inputs: pipeline.flow.predict(settings, step, inputs, StageTimer(pipeline.device))),
            "step_graphs": [graph for graph, _, _ in calls]})
    return batches
