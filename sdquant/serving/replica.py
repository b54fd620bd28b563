"""The model deployment: one replica's pipeline, built and warmed once before it reports ready, then
drawing the batches Ray gathers (@serve.batch, at most the batch limit of images), each request's
images as PNGs or its video as an MP4, with the call's seconds per stage."""

from __future__ import annotations

import asyncio
import dataclasses
import io
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ray import serve

from .. import report
from ..errors import UserError
from ..families.pipeline import NOISY_SCHEDULERS, SamplingSettings
from .batching import Call, call_latents, images_of, padded, plan_calls, split, taken

# Threads that encode answers while the pipeline draws the next call: a 1024x1024 PNG takes tens
# of milliseconds of CPU, and eight of them in the pipeline's thread would hold up the next call.
ENCODERS = 4
# Gatherings of requests handed on to the queue at once: each returns only when its requests are
# drawn, so one at a time would hold the next arrivals out of the queue.
GATHERED_AT_ONCE = 1024


@dataclass
class Drawing:
    """One request's answer from a replica: its files (a PNG an image, or an MP4 a video) and their
    seeds, the seconds of the call that drew it (and per stage), and that call's images; or the
    reason it was refused (the pipeline cannot run it: a size past the engines' profiles). Until
    encoded, `pixels` holds the request's samples and `files` is empty."""

    files: list[bytes] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    call_seconds: float = 0.0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    batch_images: int = 0
    refusal: str | None = None
    pixels: object = field(default=None, repr=False)
    settings: SamplingSettings | None = field(default=None, repr=False)


class ModelReplica:
    """The pipeline of a settled serve config. Requests that arrive within serve.batch_wait_timeout_s
    of each other are gathered (@serve.batch) into the replica's queue; whenever the pipeline is
    free, its next call takes the first waiting request and those that can share its call, up to
    serve.max_batch_size images. So under load a call takes all that arrived while the last one
    drew, not what came in the 50 ms after it started."""

    def __init__(self, app, max_batch_size: int, batch_wait_timeout_s: float, warm_batches: tuple[int, ...]):
        from ..api import build

        self.pipe = build(app)
        self.max_images = max_batch_size
        # A call pads to the smallest batch the pipeline was warmed at, so that no request's batch
        # compiles the backbone again while others wait.
        self.warm_batches = sorted({*warm_batches, max_batch_size})
        run = self.pipe.run_settings
        self.seeds_mix = (run.scheduler or run.family.default_scheduler) not in NOISY_SCHEDULERS
        self.gather.set_max_batch_size(max_batch_size)
        self.gather.set_batch_wait_timeout_s(batch_wait_timeout_s)
        self.waiting: list[tuple[SamplingSettings, asyncio.Future]] = []
        self.drawing: asyncio.Task | None = None
        # torch keeps grad mode, the current stream and compiled CUDA graphs per thread: every call
        # runs on the one thread that warmed the pipeline, off the event loop, so Ray keeps gathering.
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipeline")
        self.encoders = ThreadPoolExecutor(max_workers=ENCODERS, thread_name_prefix="encode")
        self.worker.submit(self.warm).result()

    def warm(self) -> None:
        """A call at the configured geometry for each batch calls pad to, so that the first
        requests find the shapes compiled and set up."""
        for images in self.warm_batches:
            self.pipe.run(self.pipe.settle(["warm-up"], num_images_per_prompt=images), progress=False)

    async def draw(self, settings: SamplingSettings) -> Drawing:
        drawing = await self.gather(settings)
        if drawing.refusal is not None:
            return drawing
        # Encoded once its call has given the pipeline back: the next call draws meanwhile.
        return await asyncio.get_running_loop().run_in_executor(self.encoders, encoded, drawing)

    @serve.batch(max_batch_size=1, batch_size_fn=images_of, max_concurrent_batches=GATHERED_AT_ONCE)
    async def gather(self, batch: list[SamplingSettings]) -> list[Drawing]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in batch]
        self.waiting += zip(batch, futures)
        if self.drawing is None or self.drawing.done():
            self.drawing = loop.create_task(self.draw_while_waiting())
        return list(await asyncio.gather(*futures))

    async def draw_while_waiting(self) -> None:
        """Calls one after another while requests wait, each answering its own requests."""
        loop = asyncio.get_running_loop()
        while self.waiting:
            chosen = taken([settings for settings, _ in self.waiting], self.max_images, self.seeds_mix)
            call = [self.waiting[index] for index in chosen]
            self.waiting = [entry for index, entry in enumerate(self.waiting) if index not in chosen]
            try:
                answers = await loop.run_in_executor(self.worker, self.draw_all, [settings for settings, _ in call])
            except Exception as error:  # a failed call fails its own requests; the queue goes on
                answers = [error] * len(call)
            for (_, future), answer in zip(call, answers):
                if future.done():
                    continue
                if isinstance(answer, Exception):
                    future.set_exception(answer)
                else:
                    future.set_result(answer)

    def draw_all(self, batch: list[SamplingSettings]) -> list[Drawing]:
        answers: dict[int, Drawing] = {}
        runnable = []
        for index, settings in enumerate(batch):
            try:
                self.pipe.check(settings)
                runnable.append(index)
            except UserError as error:
                answers[index] = Drawing(refusal=str(error))
        requests = [batch[index] for index in runnable]
        for call in plan_calls(requests, self.max_images, self.seeds_mix):
            for member, drawing in self.draw_call(requests, call).items():
                answers[runnable[member]] = drawing
        return [answers[index] for index in range(len(batch))]

    def draw_call(self, requests: list[SamplingSettings], call: Call) -> dict[int, Drawing]:
        """One pipeline call of its members' images, each request's own noise in it, padded to a
        warmed batch."""
        images = len(call.settings.image_prompts)
        call = padded(call, next(size for size in self.warm_batches if size >= images))
        drawn = self.pipe.run(call.settings, progress=False, latents=call_latents(self.pipe.flow, requests, call))
        stage_seconds = {stage: sum(seconds) for stage, seconds in drawn.stage_seconds.items()}
        return {member: Drawing(seeds=requests[member].seeds, call_seconds=drawn.seconds,
                                stage_seconds=stage_seconds, batch_images=images, pixels=report.to_pixels(samples),
                                settings=requests[member])
                for member, samples in split(drawn.samples, requests, call).items()}


def encoded(drawing: Drawing) -> Drawing:
    """The drawing with its samples as files: a PNG an image, an MP4 a video, their settings in the
    metadata."""
    settings, files = drawing.settings, []
    for seed, pixels in zip(settings.seeds, drawing.pixels):
        text = {"prompt": settings.prompts[0], "seed": seed, "steps": settings.steps,
                "guidance_scale": settings.guidance_scale, "fps": settings.fps}
        buffer = io.BytesIO()
        (report.encode_mp4 if pixels.ndim == 4 else report.encode_png)(pixels, buffer, text)
        files.append(buffer.getvalue())
    return dataclasses.replace(drawing, files=files, pixels=None, settings=None)
