"""serve.py: the config settled (every value checked) before Ray starts; Ray started or joined, the
application deployed and every replica warm; then served until Ctrl-C or SIGTERM, which refuse new
requests, drain those admitted within serve.drain_timeout_s, and stop Serve and Ray."""

from __future__ import annotations

import signal
import sys
import time

from ..cli import EXIT_INTERRUPTED, stage
from ..errors import UserError
from ..runs.serve import ServeRun, settle_serve
from ..serving.app import APPLICATION, application

# What a shell reports for a command ended by SIGTERM: 128 + 15.
EXIT_TERMINATED = 143
POLL_SECONDS = 0.2


class Stopped(Exception):
    """SIGTERM, raised where the server waits, to drain as Ctrl-C does."""


def run_serve(cfg) -> None:
    """serve.py at its edge: the Hydra config settled, then served until stopped."""
    serve_until_stopped(settle_serve(cfg))


def serve_until_stopped(run: ServeRun) -> None:
    import ray

    connected = not ray.is_initialized()
    # A cluster joined (serve.address) is others' too: stopping removes this application alone.
    owned = connected and not run.block.address
    try:
        with stage("starting the server"):
            if connected:
                ray.init(address=run.block.address or None, include_dashboard=False)
            ingress = deploy(run)
        block = run.block
        print(f"serving model={run.app.model.name} at http://{block.host}:{block.port} "
              f"({block.num_replicas} replica{'s' if block.num_replicas > 1 else ''} warm); Ctrl-C stops it",
              flush=True)
        code = wait_for_stop()
        with stage("draining the requests held"):
            line = drain(ingress, run)
    finally:
        with stage("stopping Serve and Ray"):
            stop(owned, connected)
    print(line, file=sys.stderr, flush=True)
    sys.exit(code)


def deploy(run: ServeRun):
    """Serve started on serve.host and serve.port and the application running, every replica built
    and warm; the ingress's handle."""
    import ray
    from ray import serve

    needed = run.gpus_per_replica * run.block.num_replicas
    if needed and ray.cluster_resources().get("GPU", 0) < needed:
        raise UserError(f"serve.num_replicas={run.block.num_replicas} at {run.gpus_per_replica:g} GPU each need "
                        f"{needed:g} GPUs and the Ray cluster has {ray.cluster_resources().get('GPU', 0):g}: join "
                        "GPU nodes (serve.address), or serve on the CPU with device=cpu")
    serve.start(http_options={"host": run.block.host, "port": run.block.port})
    return serve.run(application(run), name=APPLICATION, route_prefix="/")


def wait_for_stop() -> int:
    """Waits for Ctrl-C or SIGTERM; the exit code that says which."""

    def terminated(signum, frame):
        raise Stopped()

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        while True:
            time.sleep(POLL_SECONDS)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Stopped:
        return EXIT_TERMINATED
    finally:
        signal.signal(signal.SIGTERM, previous)


def drain(ingress, run: ServeRun) -> str:
    """New requests refused, those held given serve.drain_timeout_s to finish; the line that says
    how it went."""
    held = ingress.drain.remote().result()
    deadline = time.monotonic() + run.block.drain_timeout_s
    left = held
    while left and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)
        left = ingress.held_requests.remote().result()
    line = f"stopped serving model={run.app.model.name}: {held - left} of the {held} requests held answered"
    if left:
        line += f", {left} cut off after serve.drain_timeout_s={run.block.drain_timeout_s:g}"
    return line


def stop(owned: bool, connected: bool) -> None:
    """Serve and Ray stopped where this process started them (`owned`); else the application alone
    removed, and the cluster left (`connected`: this process joined it)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    if owned:
        serve.shutdown()
    else:
        serve.delete(APPLICATION)
    if connected:
        ray.shutdown()
