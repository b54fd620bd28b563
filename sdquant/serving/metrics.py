"""The server's Prometheus metrics, in a registry of its own (nothing of the process's default one):
requests held, refused by reason and answered by route and status, the images each call drew, and
the seconds of each stage of a request."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)


class ServeMetrics:
    def __init__(self, max_batch_size: int):
        self.registry = CollectorRegistry()
        self.queue_depth = Gauge("sdquant_serve_queue_depth", "requests admitted and not yet answered",
                                 registry=self.registry)
        self.refused = Counter("sdquant_serve_requests_refused", "requests refused, by reason", ["reason"],
                               registry=self.registry)
        self.answered = Counter("sdquant_serve_requests", "requests answered, by route and HTTP status",
                                ["route", "status"], registry=self.registry)
        self.batch_images = Histogram("sdquant_serve_batch_images", "images of the pipeline call each request was drawn in",
                                      buckets=tuple(range(1, max_batch_size + 1)), registry=self.registry)
        self.stage_seconds = Histogram("sdquant_serve_stage_seconds",
                                       "seconds of a request in each stage: waiting, each pipeline stage, the whole",
                                       ["stage"], buckets=SECONDS, registry=self.registry)

    def drawn(self, total_seconds: float, call_seconds: float, stage_seconds: dict, batch_images: int) -> None:
        """One request answered by a call of `batch_images` images: its wait outside the call, the
        call's stages, and its whole time in the server."""
        self.batch_images.observe(batch_images)
        self.stage_seconds.labels("waiting").observe(max(total_seconds - call_seconds, 0.0))
        for stage, seconds in stage_seconds.items():
            self.stage_seconds.labels(stage).observe(seconds)
        self.stage_seconds.labels("end_to_end").observe(total_seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)
