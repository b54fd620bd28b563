"""The HTTP ingress (FastAPI on Ray Serve), in OpenAI's shape: images and video jobs under /v1 (an
API key where one is set), /health and /metrics. Every request is checked here, and bounded (body,
prompt, images, requests held) before anything reaches a replica; every one admitted gets one
answer; each is logged in one line (Serve's access log of the ingress)."""


import asyncio
import base64
import hmac
import json
import math
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError

from ..runs.model import settle_model
from ..runs.sample import defaults_of
from .metrics import ServeMetrics
from .requests import ImageRequest, RequestError, Served, VideoRequest, named_field, settle_request

ROUTES = {"image": "POST /v1/images/generations", "video": "POST /v1/videos"}
http = FastAPI(title="sdquant")


@dataclass
class VideoJob:
    """A video request's state as GET /v1/videos/{id} tells it, and its MP4 once drawn."""

    id: str
    created_at: int
    model: str
    size: str
    frames: int
    seed: int
    status: str = "queued"
    error: dict | None = None
    mp4: bytes | None = field(default=None, repr=False)

    def described(self) -> dict:
        return {"id": self.id, "object": "video", "created_at": self.created_at, "status": self.status,
                "model": self.model, "size": self.size, "frames": self.frames, "seed": self.seed,
                "error": self.error}


def capacity(block) -> int:
    """Requests the server holds at once: a batch in each replica, and serve.max_queued_requests waiting."""
    return block.max_queued_requests + block.num_replicas * block.max_batch_size


def error_response(error: RequestError, retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse({"error": {"message": error.message, "type": error.kind, "param": error.param}},
                        status_code=error.status, headers=headers)


def described(error: ValidationError) -> tuple[str, str | None]:
    """pydantic's first complaint about a body as one message, and the field it names."""
    first = error.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    if first["type"] == "extra_forbidden":
        return f"{param} is no field of this request", param
    if first["type"] == "missing":
        return f"{param} is missing", param
    return f"{param}: {first['msg']}", param


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(http)
class Ingress:
    def __init__(self, replicas, app, api_key: str | None, application: str, model_deployment: str):
        block = app.serve
        model = settle_model(app.model, drawing=True)
        self.replicas = replicas
        self.served = Served(model, defaults_of(app.sampling), block.max_images_per_request, block.max_prompt_chars,
                             block.max_steps)
        self.output = model.family.output
        self.block, self.api_key = block, api_key
        self.application, self.model_deployment = application, model_deployment
        self.capacity = capacity(block)
        self.held = 0
        self.draining = False
        self.last_call_seconds = 1.0
        self.jobs: OrderedDict[str, VideoJob] = OrderedDict()
        self.video_tasks: set[asyncio.Task] = set()
        self.metrics = ServeMetrics(block.max_batch_size)

    @http.post("/v1/images/generations")
    async def images(self, request: Request):
        try:
            settings = await self.admitted(request, ImageRequest, "image")
        except RequestError as error:
            return self.refused(error, "images")
        try:
            drawing = await self.drawn(settings)
        except RequestError as error:
            return self.refused(error, "images")
        finally:
            self.release()
        data = [{"b64_json": base64.b64encode(png).decode(), "seed": seed}
                for png, seed in zip(drawing.files, drawing.seeds)]
        self.metrics.answered.labels("images", "200").inc()
        return {"created": int(time.time()), "data": data}

    @http.post("/v1/videos")
    async def videos(self, request: Request):
        try:
            settings = await self.admitted(request, VideoRequest, "video")
        except RequestError as error:
            return self.refused(error, "videos")
        job = VideoJob(f"video_{uuid.uuid4().hex}", int(time.time()), self.served.name,
                       f"{settings.width}x{settings.height}", settings.frames, settings.seed)
        self.jobs[job.id] = job
        self.forget_old_jobs()
        # asyncio holds tasks weakly: kept here until done.
        task = asyncio.get_running_loop().create_task(self.draw_video(job, settings))
        self.video_tasks.add(task)
        task.add_done_callback(self.video_tasks.discard)
        self.metrics.answered.labels("videos", "200").inc()
        return job.described()

    @http.get("/v1/videos/{video_id}")
    async def video(self, video_id: str, request: Request):
        try:
            self.authorize(request)
            return self.job(video_id).described()
        except RequestError as error:
            return self.refused(error, "videos")

    @http.get("/v1/videos/{video_id}/content")
    async def video_content(self, video_id: str, request: Request):
        try:
            self.authorize(request)
            job = self.job(video_id)
            if job.status != "completed":
                raise RequestError(f"video {video_id} is {job.status}, not completed", "video_id", 409)
        except RequestError as error:
            return self.refused(error, "videos")
        return Response(job.mp4, media_type="video/mp4")

    @http.get("/health")
    async def health(self):
        # serve.status() waits on Ray's controller: off the event loop, which other requests share.
        warm, target = await asyncio.to_thread(self.replicas_warm)
        body = {"status": "ok" if warm >= target else "starting", "replicas_warm": warm, "replicas": target}
        return JSONResponse(body, status_code=200 if warm >= target else 503)

    @http.get("/metrics")
    async def metrics_text(self):
        return Response(self.metrics.text(), media_type="text/plain; version=0.0.4")

    def drain(self) -> int:
        """Refuses new requests from now on; returns the requests still held."""
        self.draining = True
        return self.held

    def held_requests(self) -> int:
        """Requests admitted and not yet answered, video jobs among them."""
        return self.held

    async def admitted(self, request: Request, schema, output: str):
        """The request's call settings, once it is authorized, well formed and within bounds, and
        there is room for it; a RequestError otherwise."""
        self.authorize(request)
        if output != self.output:
            raise RequestError(f"this server's model {self.served.name} draws {self.output}s: use "
                               f"{ROUTES[self.output]}", None, 404)
        body = await self.body(request)
        try:
            asked = schema.model_validate(body)
        except ValidationError as error:
            raise RequestError(*described(error)) from None
        settings = settle_request(asked, self.served)
        if self.draining:
            raise RequestError("the server is shutting down", None, 503, "server_unavailable")
        if self.held >= self.capacity:
            raise RequestError(f"the server holds {self.held} requests, as many as it takes: try again shortly",
                               None, 503, "server_overloaded")
        self.held += 1
        self.metrics.queue_depth.set(self.held)
        return settings

    def release(self) -> None:
        self.held -= 1
        self.metrics.queue_depth.set(self.held)

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise RequestError("missing or wrong API key: send the header Authorization: Bearer <key>", None, 401,
                               "authentication_error")

    async def body(self, request: Request):
        """The request's JSON, read up to the server's bound."""
        limit = self.block.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise RequestError(f"the body has {declared} bytes, more than this server takes ({limit})", None, 413)
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise RequestError(f"the body is longer than this server takes ({limit} bytes)", None, 413)
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            raise RequestError("the body is not JSON", None) from None

    async def drawn(self, settings):
        """The replica's drawing of `settings`; a RequestError where it refuses it or dies."""
        start = time.perf_counter()
        try:
            drawing = await self.replicas.draw.remote(settings)
        except (RayActorError, ActorUnavailableError) as error:
            raise RequestError(f"the replica drawing this request stopped ({type(error).__name__}); Ray starts it "
                               "again: send the request again", None, 503, "replica_died") from None
        except Exception as error:  # answered in the API's shape, with the reason's name, never a bare 500
            raise RequestError(f"the server failed drawing this request ({type(error).__name__}); the server's log "
                               "has the rest", None, 500, "server_error") from None
        if drawing.refusal is not None:
            raise RequestError(*named_field(drawing.refusal))
        self.last_call_seconds = drawing.call_seconds
        self.metrics.drawn(time.perf_counter() - start, drawing.call_seconds, drawing.stage_seconds,
                           drawing.batch_images)
        return drawing

    async def draw_video(self, job: VideoJob, settings) -> None:
        job.status = "in_progress"
        try:
            drawing = await self.drawn(settings)
            job.mp4, job.status = drawing.files[0], "completed"
        except RequestError as error:
            job.status, job.error = "failed", {"message": error.message, "type": error.kind}
        except Exception as error:  # every job ends answered, whatever failed under it
            job.status, job.error = "failed", {"message": f"the server failed drawing it ({type(error).__name__})",
                                               "type": "server_error"}
        finally:
            self.release()

    def job(self, video_id: str) -> VideoJob:
        if video_id not in self.jobs:
            raise RequestError(f"no video {video_id} on this server (finished jobs are kept for the last "
                               f"{self.block.kept_video_jobs})", "video_id", 404)
        return self.jobs[video_id]

    def forget_old_jobs(self) -> None:
        finished = [key for key, job in self.jobs.items() if job.status in ("completed", "failed")]
        for key in finished[:max(len(finished) - self.block.kept_video_jobs, 0)]:
            del self.jobs[key]

    def refused(self, error: RequestError, route: str) -> JSONResponse:
        self.metrics.refused.labels(error.kind).inc()
        self.metrics.answered.labels(route, str(error.status)).inc()
        retry_after = math.ceil(self.last_call_seconds) if error.status == 503 else None
        return error_response(error, retry_after)

    def replicas_warm(self) -> tuple[int, int]:
        """(replicas running, replicas asked for): a replica runs once its pipeline is built and warm."""
        application = serve.status().applications.get(self.application)
        deployment = application.deployments.get(self.model_deployment) if application else None
        if deployment is None:
            return 0, self.block.num_replicas
        return deployment.replica_states.get("RUNNING", 0), self.block.num_replicas



APPLICATION = "sdquant"
MODEL_DEPLOYMENT = "ModelReplica"
# Room on the ingress beyond the image and video requests it admits: /health, /metrics, job polls.
SIDE_REQUESTS = 64


def application(run):
    """The Serve application of a settled serve run: the ingress before `num_replicas` model
    replicas, each holding at most a batch of requests."""
    from .replica import ModelReplica

    block = run.block
    replicas = serve.deployment(ModelReplica, name=MODEL_DEPLOYMENT).options(
        # Room for what waits beside a call, so that it waits in the replica's queue, where the next
        # call can take it, and not in Ray's router.
        num_replicas=block.num_replicas, max_ongoing_requests=block.max_batch_size + block.max_queued_requests,
        # The ingress logs each request in one line (Serve's access log); its calls here, none.
        logging_config={"enable_access_log": False},
        ray_actor_options={"num_cpus": block.cpus_per_replica, "num_gpus": run.gpus_per_replica})
    ingress = Ingress.options(max_ongoing_requests=capacity(block) + SIDE_REQUESTS)
    return ingress.bind(replicas.bind(run.app, block.max_batch_size, block.batch_wait_timeout_s, tuple(block.warm_batches)), run.app,
                        run.api_key, APPLICATION, MODEL_DEPLOYMENT)
