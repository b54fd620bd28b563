"""serve.py's config settled before Ray starts: the pipeline each replica builds (every value of
infer_trt.py's keys checked, the model's folder read without weights), the server's block, its API
key and the GPUs a replica asks for."""

from __future__ import annotations

from dataclasses import dataclass

from .. import report
from ..config import ServeApp, serve_api_key, settled_config, validate_serve
from .infer import settle_called_pipeline


@dataclass(frozen=True)
class ServeRun:
    app: ServeApp
    api_key: str | None
    gpus_per_replica: float

    @property
    def block(self):
        return self.app.serve


def settle_serve(cfg) -> ServeRun:
    app = settled_config(cfg)
    validate_serve(app.serve)
    run = settle_called_pipeline(app)
    report.require_writer(run.family.output, app.model.name)
    gpus = app.serve.gpus_per_replica
    if gpus is None:
        gpus = 0.0 if app.device == "cpu" else 1.0
    return ServeRun(app, serve_api_key(app.serve), gpus)
