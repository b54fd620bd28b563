"""infer_trt.py: the pipeline built once (sdquant.assembly) on the engines, their ONNX files or the
diffusers modules, each prompt batch drawn with it once and written, and a latency report from the
drawing itself."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from .. import parallel, report
from ..assembly import Drawn, Pipeline, assemble
from ..cli import stage
from ..report import library_versions, print_summary
from ..runs.infer import InferRun, settle_infer
from ..runtime.attention_window import write_shares


@dataclass(frozen=True)
class Drawing:
    """What a process's prompt batches wrote and took: its first call (which compiles or sets up),
    its later calls, and its later batches' samples in the seconds from the end of the first call
    until their last file was written (0 without a later batch)."""

    written: list[Path]
    first: Drawn
    later: list[Drawn]
    later_seconds: float
    nonfinite_values: int

    @property
    def later_samples(self) -> int:
        return sum(len(drawn.settings.image_prompts) for drawn in self.later)


def run_infer(cfg) -> dict:
    """infer_trt.py at its edge: the Hydra config settled (every value checked), then drawn."""
    return infer(settle_infer(cfg))


def infer(run: InferRun) -> dict:
    """This process's share of the prompt batches drawn (all of them in one process; under torchrun
    or as one of shard.count jobs, batch i on part i mod parts, with its global seed and file names),
    and one latency report for all the parts."""
    start = time.perf_counter()
    world = parallel.current_world()
    try:
        pipeline = assemble(run.pipeline)
        place = pipeline.place
        part = parallel.share_of(place.replicas, run.shard)
        mine = parallel.shard(list(run.sampling.runs), part, "prompt batches (prompts / sampling.batch_size)")
        for _, settings in mine:
            pipeline.check(settings, "sampling.cache")
        out = run.out_path
        files = {name: str(file.path) for name, file in run.pipeline.files.items()}
        with report.WRITERS[pipeline.family.output](out, files, run.pipeline.backend) as writer:
            drawing = _draw(pipeline, mine, len(run.sampling.runs), writer if place.writes else None)
        latency = _latency(pipeline, run, drawing)
        window = run.pipeline.torch_backend.attention_window
        if window.record_to:
            drawing.written.append(write_shares(pipeline.family, pipeline.modules, window.frames,
                                                Path(window.record_to)))
        note = None
        if run.pipeline.backend == "torch":
            from ..runtime.attention import chosen_kernel, fallback_note

            asked = run.pipeline.torch_backend.attention_kernel
            latency["attention_kernel_setting"] = chosen_kernel(asked, pipeline.device)
            note = fallback_note(asked, pipeline.device)
        # One latency per group of processes that share a sample: its writer's.
        parts = parallel.gather((latency, drawing.written) if place.writes else None, world)
        latencies = [each[0] for each in parts if each]
        written = sum((each[1] for each in parts if each), [])
        if not world.is_main:
            return latency
        merged = latencies[0] if len(latencies) == 1 else report.merged_latency(latencies)
        merged.update({"versions": library_versions(), "settings": run.record})
        if run.shard.count > 1:
            written.append(report.write_report(out, merged, f"latency.shard{run.shard.index}of{run.shard.count}.json"))
            merged = report.merge_shard_reports(out, run.shard.count) or merged
        report.print_latency(merged)
        if run.shard.count == 1 or "shards" in merged:
            written.append(report.write_report(out, merged))
        print_summary("inference", sorted(written), time.perf_counter() - start, notes=[note] if note else [])
        return merged
    finally:
        parallel.stop(world)


def _draw(pipeline: Pipeline, mine: list, total: int, writer: report.ImageWriter | None) -> Drawing:
    """Each of `mine` (index, settings) drawn once, its samples queued on `writer` (None: another
    process of its group writes them)."""

    def draw(index: int, settings) -> Drawn:
        with stage(f"prompt batch {index + 1} of {total}"):
            drawn = pipeline.run(settings)
            if writer is not None:
                writer.submit(drawn.samples, index, settings)
            # The report keeps the call's times; its samples, once queued, go.
            return dataclasses.replace(drawn, samples=None)

    first = draw(*mine[0])
    first_end = time.perf_counter()
    later = [draw(index, settings) for index, settings in mine[1:]]
    with stage("writing the last images"):
        written = writer.finish() if writer is not None else []
    later_seconds = time.perf_counter() - first_end if later else 0.0
    return Drawing(written, first, later, later_seconds, writer.nonfinite_values if writer is not None else 0)


def _latency(pipeline: Pipeline, run: InferRun, drawing: Drawing) -> dict:
    """The latency report: from the runs of the first batch asked for (num_timed_runs, after
    num_warmup_runs), else from the later batches of the first's size, else from the first call
    itself; with the first call's time and its set-up beyond a call, and the later batches' rate."""
    first = drawing.first
    timed = _timed_runs(pipeline, first.settings, run.warmup_runs, run.timed_runs)
    source = "timed runs of the first prompt batch"
    if not timed:
        images = len(first.settings.image_prompts)
        timed = [drawn for drawn in drawing.later if len(drawn.settings.image_prompts) == images]
        source = "the later prompt batches"
    if not timed:
        timed, source = [first], "the first call (it holds any compiling and set-up)"
    settings = first.settings
    latency = report.latency_report([(drawn.seconds, drawn.stage_seconds) for drawn in timed],
                                    len(settings.image_prompts), settings.steps,
                                    [backbone.graph for backbone in pipeline.family.backbones])
    latency["timed"] = source
    passes = report.summed_passes([drawn.cache_passes for drawn in timed])
    if passes:
        latency["cache_passes"] = passes
    # The first call compiles (torch_backend.compile) or sets engines and graphs up: its excess
    # over a later call is what a user waits once per process and shape.
    latency["first_call_seconds"] = first.seconds
    latency["after_first_batch"] = report.after_first_batch(drawing.later_samples, drawing.later_seconds)
    latency["setup_seconds"] = report.setup_seconds(first.seconds, latency["ms"]["end_to_end"])
    latency.update({"backend": run.pipeline.backend, "device": report.device_name(pipeline.device),
                    "output": pipeline.family.output, "images_written": len(drawing.written),
                    "nonfinite_values": drawing.nonfinite_values})
    return latency


def _timed_runs(pipeline: Pipeline, settings, warmup_runs: int, timed_runs: int) -> list[Drawn]:
    """num_warmup_runs, then num_timed_runs of the first batch once every file is written (so that
    no encoding competes with them): a benchmark's option, none by default."""
    if not timed_runs:
        return []
    with stage("the warm-up and timed runs"):
        for _ in range(warmup_runs):
            pipeline.run(settings, progress=False)
        return [pipeline.run(settings, progress=False) for _ in range(timed_runs)]
