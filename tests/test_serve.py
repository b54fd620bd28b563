"""serve.py: the pipeline behind a real Ray Serve on this machine's loopback. Concurrent requests are
batched and each image is what the Python API draws for its prompt and seed alone; bad requests,
missing keys and a full queue are refused as the HTTP API says; a killed replica comes back; a
video job runs to an MP4; the script drains on Ctrl-C and leaves no Ray process behind."""

from __future__ import annotations

import base64
import dataclasses
import io
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from sdquant import report
from sdquant.api import load
from sdquant.families.pipeline import SamplingSettings
from sdquant.serving.batching import padded, plan_calls, split, taken

from conftest import REPO, compose_config

# One worker holds the module's Ray cluster and servers (pyproject's --dist loadgroup).
pytestmark = pytest.mark.xdist_group("ray_serve")

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SCENES = ["model=scenes_sdxl", "backend=torch", "device=cpu", "sampling.steps=4"]
PROMPTS = ["a small red circle on the left, white background", "a big blue square on the right, white background",
           "a green triangle in the middle, white background", "a small yellow circle at the top, white background"]
# Room for exactly the 16 concurrent clients: two replicas of a 4-image batch, and 8 waiting.
SCENES_SERVE = ["serve.num_replicas=2", "serve.cpus_per_replica=1", "serve.max_batch_size=4",
                "serve.batch_wait_timeout_s=0.5", "serve.max_queued_requests=8", "serve.max_images_per_request=2",
                "serve.max_prompt_chars=200", "serve.max_steps=400", f"serve.api_key={KEY}"]
WAN = ["model=tiny_wan", "backend=torch", "device=cpu", "sampling.steps=3", "sampling.num_frames=5"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(model_cache):
    """One small Ray cluster for the module, Serve's HTTP on a free loopback port."""
    import ray
    from ray import serve

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 2**20, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()
    ray.shutdown()


def served(cluster, overrides: list[str]):
    """The application of serve.py's config with `overrides` deployed on the module's cluster, as
    serve.py deploys it; its base URL; removed after."""
    from ray import serve

    from sdquant.runs.serve import settle_serve
    from sdquant.serving.app import APPLICATION
    from sdquant.workflow.serve import deploy

    deploy(settle_serve(compose_config("sd_xl_serve", [*overrides, f"serve.port={cluster}"])))
    yield f"http://127.0.0.1:{cluster}"
    serve.delete(APPLICATION)


@pytest.fixture(scope="module")
def scenes(cluster):
    yield from served(cluster, [*SCENES, *SCENES_SERVE])


@pytest.fixture(scope="module")
def scenes_api(model_cache):
    with load("scenes_sdxl", SCENES[1:]) as pipe:
        yield pipe


def generate(url: str, body: dict, headers=AUTH, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{url}/v1/images/generations", json=body, headers=headers, timeout=timeout)


def pixels_of(response: httpx.Response) -> list[np.ndarray]:
    return [np.asarray(Image.open(io.BytesIO(base64.b64decode(item["b64_json"])))) for item in response.json()["data"]]


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_the_serve_config_takes_the_inference_configs_keys():
    from omegaconf import OmegaConf

    serving = OmegaConf.to_container(compose_config("sd_xl_serve", ["model=scenes_sdxl"]))
    assert serving.pop("serve")["host"] == "127.0.0.1"
    assert serving == OmegaConf.to_container(compose_config("sd_xl_trt_inference", ["model=scenes_sdxl"]))


def test_requests_that_share_settings_share_a_call_of_at_most_the_batch_limit():
    def asked(prompts: int, steps: int = 4) -> SamplingSettings:
        return SamplingSettings(prompts=["p"], negative_prompt="", steps=steps, guidance_scale=5.0, height=64,
                                width=64, seed=0, images_per_prompt=prompts)

    requests = [asked(1), asked(2), asked(1, steps=8), asked(2), asked(1)]
    calls = plan_calls(requests, max_images=4, seeds_mix=True)
    assert [call.members for call in calls] == [(0, 1), (3, 4), (2,)]
    assert [len(call.settings.image_prompts) for call in calls] == [3, 3, 1]
    assert [call.members for call in plan_calls(requests, 4, seeds_mix=False)] == [(0,), (1,), (2,), (3,), (4,)]
    # The next call once the pipeline is free: the first waiting request and those that fit with it.
    assert taken(requests, max_images=4, seeds_mix=True) == [0, 1, 4]
    assert taken(requests[2:], max_images=4, seeds_mix=True) == [0]
    assert taken(requests, max_images=4, seeds_mix=False) == [0]
    chunked = [dataclasses.replace(asked(1), long_prompts="chunk") for _ in range(2)]
    assert taken(chunked, max_images=4, seeds_mix=True) == [0], "chunked prompts pad each other's windows"


def test_a_call_pads_to_a_warmed_batch_and_drops_the_padding():
    settings = SamplingSettings(prompts=["p"], negative_prompt="", steps=4, guidance_scale=5.0, height=64, width=64,
                                seed=3, images_per_prompt=2)
    (call,) = plan_calls([settings], max_images=4, seeds_mix=True)
    wider = padded(call, 4)
    assert (wider.padding, wider.settings.prompts) == (2, ["p", "p", "", ""])
    samples = torch.arange(4.0).reshape(4, 1)
    assert split(samples, [settings], wider)[0].flatten().tolist() == [0.0, 1.0]


def test_concurrent_clients_are_batched_and_each_gets_what_the_api_draws_alone(scenes, scenes_api):
    assert httpx.get(f"{scenes}/health", timeout=10).status_code == 200
    bodies = [{"prompt": PROMPTS[index % 4], "seed": 100 + index, "size": "64x64"} for index in range(16)]
    with ThreadPoolExecutor(16) as clients:
        responses = list(clients.map(lambda body: generate(scenes, body), bodies))
    assert [response.status_code for response in responses] == [200] * 16
    for body, response in zip(bodies, responses):
        (ours,) = pixels_of(response)
        (alone,) = report.to_pixels(scenes_api(body["prompt"], seed=body["seed"]).samples)
        assert response.json()["data"][0]["seed"] == body["seed"]
        assert ours.shape == alone.shape == (64, 64, 3) and ours.std() > 5
        assert np.abs(ours.astype(int) - alone.astype(int)).max() <= 1
    single = metric(scenes, 'sdquant_serve_batch_images_bucket{le="1.0"}')
    assert metric(scenes, "sdquant_serve_batch_images_count") - single > 0, "some calls drew several requests"


def test_a_requests_images_are_seeded_seed_plus_k(scenes, scenes_api):
    response = generate(scenes, {"prompt": PROMPTS[0], "seed": 7, "n": 2})
    assert [item["seed"] for item in response.json()["data"]] == [7, 8]
    alone = report.to_pixels(scenes_api(PROMPTS[0], seed=7, num_images_per_prompt=2).samples)
    assert all(np.abs(ours.astype(int) - theirs.astype(int)).max() <= 1
               for ours, theirs in zip(pixels_of(response), alone))


def test_a_request_without_a_seed_gets_a_fresh_one_it_is_told(scenes):
    seeds = [generate(scenes, {"prompt": PROMPTS[0], "size": "64x64"}).json()["data"][0]["seed"] for _ in range(2)]
    assert seeds[0] != seeds[1]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "style": "vivid"}, "style"),
    ({"prompt": "x", "frames": 5}, "frames"),
    ({"prompt": "x", "size": "63x64"}, "size"),
    ({"prompt": "x", "size": "large"}, "size"),
    ({"prompt": "x", "n": 3}, "n"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "   "}, "prompt"),
    ({"prompt": "x" * 201}, "prompt"),
    ({"n": 1}, "prompt"),
    ({"prompt": "x", "steps": 0}, "steps"),
    ({"prompt": "x", "steps": 401}, "steps"),
    ({"prompt": "x", "seed": "7"}, "seed"),
    ({"prompt": "x", "guidance_scale": -1}, "guidance_scale"),
    ({"prompt": "x", "response_format": "url"}, "response_format"),
    ({"prompt": "x", "model": "sdxl_base"}, "model"),
])
def test_a_bad_request_is_refused_with_400_naming_its_field_before_any_replica(scenes, body, param):
    drawn = metric(scenes, "sdquant_serve_batch_images_count")
    response = generate(scenes, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error") and param in error["message"]
    assert metric(scenes, "sdquant_serve_batch_images_count") == drawn


def test_a_request_without_the_key_gets_401_and_the_video_route_names_the_image_route(scenes):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = generate(scenes, {"prompt": PROMPTS[0]}, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    response = httpx.post(f"{scenes}/v1/videos", json={"prompt": "x"}, headers=AUTH, timeout=10)
    assert response.status_code == 404 and "/v1/images/generations" in response.json()["error"]["message"]


def test_a_full_queue_refuses_at_once_with_503_and_answers_every_admitted_request(scenes):
    refused_before = metric(scenes, 'sdquant_serve_requests_refused_total{reason="server_overloaded"}')
    bodies = [{"prompt": PROMPTS[index % 4], "seed": index} for index in range(40)]
    with ThreadPoolExecutor(40) as clients:
        responses = list(clients.map(lambda body: generate(scenes, body), bodies))
    statuses = [response.status_code for response in responses]
    assert set(statuses) == {200, 503} and statuses.count(200) >= 16
    full = [response for response in responses if response.status_code == 503]
    assert all(int(response.headers["Retry-After"]) >= 1 for response in full)
    assert all(response.json()["error"]["type"] == "server_overloaded" for response in full)
    assert metric(scenes, 'sdquant_serve_requests_refused_total{reason="server_overloaded"}') - refused_before == \
        len(full)
    assert metric(scenes, "sdquant_serve_queue_depth") == 0


def test_a_killed_replica_comes_back_and_later_requests_succeed(scenes):
    import ray

    def replicas() -> set[str]:
        return {actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
                if "ModelReplica" in actor["name"]}

    before = replicas()
    assert len(before) == 2
    with ThreadPoolExecutor(1) as client:
        # A long call, so that it is in flight when its replica goes.
        in_flight = client.submit(generate, scenes, {"prompt": PROMPTS[1], "steps": 400, "n": 2})
        time.sleep(2)
        for name in before:
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        cut = in_flight.result()
    assert cut.status_code == 503 and "stopped" in cut.json()["error"]["message"]
    deadline = time.monotonic() + 150
    while httpx.get(f"{scenes}/health", timeout=10).status_code != 200 and time.monotonic() < deadline:
        time.sleep(1)
    assert generate(scenes, {"prompt": PROMPTS[2], "seed": 3}).status_code == 200
    assert len(replicas()) == 2 and not replicas() & before


def serve_load(url: str, out, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "serve_load.py"), "--url", url, "--api-key", KEY,
                           "--out", str(out), "--min-queries", "4", "--size", "64x64", "--max-in-flight", "16",
                           *arguments], capture_output=True, text=True, cwd=REPO, timeout=180)


def test_serve_load_measures_offline_and_a_server_rate_with_loadgen(scenes, tmp_path):
    import json

    offline = serve_load(scenes, tmp_path / "offline.json", "--scenario", "offline", "--min-duration-s", "0.5",
                         "--expected-qps", "1", "--min-queries", "6")
    assert offline.returncode == 0, offline.stderr[-2000:]
    # A Server run at a share of the Offline rate measured first in the same invocation.
    server = serve_load(scenes, tmp_path / "server.json", "--scenario", "server", "--target-share", "0.5",
                        "--expected-qps", "1", "--min-duration-s", "2")
    assert server.returncode == 0, server.stderr[-2000:]
    for name, scenarios in (("offline", ["offline"]), ("server", ["offline", "server"])):
        results = json.loads((tmp_path / f"{name}.json").read_text())
        assert [run["scenario"] for run in results["runs"]] == scenarios
        for run in results["runs"]:
            assert run["queries"] >= 4 and run["answered"] == run["queries"] and run["failed"] == 0
            assert sum(run["server"]["requests_by_call_images"].values()) == run["queries"]
            assert run["rate_qps"] > 0 and run["latency_s"]["p99"] >= run["client_latency_s"]["min"]
        assert re.fullmatch(r"[0-9a-f]{12}", results["provenance"]["code"])
        assert results["official_mlperf_run"] is False and results["finished"] is True
    first, then = results["runs"]
    assert "p99_within_bound" in then and then["target_qps"] == pytest.approx(0.5 * first["rate_qps"])
    assert results["offline_images_per_s"] == first["rate_qps"]
    offline_calls = json.loads((tmp_path / "offline.json").read_text())["runs"][0]["server"]["calls_by_images"]
    assert max(int(images) for images in offline_calls) > 1, "queries issued at once share calls"


def test_the_server_search_bisects_to_the_largest_rate_that_holds_and_reports_every_run():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from serve_load import searched

    def measure_at(qps: float) -> dict:
        return {"target_qps": qps, "holds": qps <= 3.3}

    best, rows = searched(measure_at, 2.0, 4.0, steps=3)
    assert [row["target_qps"] for row in rows] == [4.0, 2.0, 3.0, 3.5, 3.25]
    assert best == 3.25
    assert searched(measure_at, 3.4, 6.8, steps=3)[0] is None
    assert searched(measure_at, 1.0, 2.0, steps=3) == (2.0, [{"target_qps": 2.0, "holds": True}])


@pytest.fixture(scope="module")
def wan(cluster, scenes):
    # After the SDXL application: one model's replicas at a time on the module's two CPUs.
    from ray import serve

    from sdquant.serving.app import APPLICATION

    serve.delete(APPLICATION)
    yield from served(cluster, [*WAN, "serve.max_batch_size=1", "serve.max_images_per_request=1"])


def test_a_video_job_goes_from_queued_to_an_mp4_of_the_frames_the_api_draws(wan, model_cache):
    response = httpx.post(f"{wan}/v1/videos", json={"prompt": "a red fox in the snow", "seed": 5}, timeout=30)
    job = response.json()
    assert response.status_code == 200 and job["object"] == "video" and job["status"] in ("queued", "in_progress")
    deadline = time.monotonic() + 120
    while job["status"] in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.5)
        job = httpx.get(f"{wan}/v1/videos/{job['id']}", timeout=10).json()
    assert job["status"] == "completed", job
    content = httpx.get(f"{wan}/v1/videos/{job['id']}/content", timeout=30)
    assert content.headers["content-type"] == "video/mp4"
    with load("tiny_wan", WAN[1:]) as pipe:
        (own,), (other,) = (report.to_pixels(pipe("a red fox in the snow", seed=seed).samples) for seed in (5, 6))
    served_frames = decoded(content.content)
    assert served_frames.shape == own.shape == (5, 32, 32, 3)
    # H.264 is lossy: the server's MP4 decodes to what the same encoding of the API's frames decodes
    # to, and not to that of another seed's.
    assert np.abs(served_frames - decoded(encoded_mp4(own))).mean() < 0.5
    assert np.abs(served_frames - decoded(encoded_mp4(other))).mean() > 5


def encoded_mp4(frames: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    report.encode_mp4(frames, buffer, {"fps": 8})
    return buffer.getvalue()


def decoded(mp4: bytes) -> np.ndarray:
    import av

    with av.open(io.BytesIO(mp4)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]).astype(int)


def test_a_bad_video_request_is_refused_and_the_image_route_names_the_video_route(wan):
    response = httpx.post(f"{wan}/v1/videos", json={"prompt": "a fox", "frames": 6}, timeout=10)
    assert response.status_code == 400 and response.json()["error"]["param"] == "frames"
    assert httpx.get(f"{wan}/v1/videos/video_unknown", timeout=10).status_code == 404
    response = generate(wan, {"prompt": "a fox"}, headers={})
    assert response.status_code == 404 and "/v1/videos" in response.json()["error"]["message"]


def test_a_bad_serve_value_is_refused_in_one_line_before_ray_starts(run_script):
    result = run_script("serve.py", "model=scenes_sdxl", "backend=torch", "device=cpu", "serve.max_batch_size=2",
                        "serve.max_images_per_request=4")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: serve.max_images_per_request=4 is more than one call draws (serve.max_batch_size=2): lower it, or "
        "raise max_batch_size"]


def test_serve_py_answers_then_drains_on_ctrl_c_and_leaves_no_ray_process(model_cache, tmp_path):
    import psutil

    port = free_port()
    # Ray's sockets live under it: short, and this test's own, to find every process it started.
    ray_dir = tempfile.mkdtemp(prefix="sdq", dir="/tmp")
    server = subprocess.Popen(
        [sys.executable, str(REPO / "serve.py"), *SCENES, f"serve.port={port}", "serve.max_steps=300",
         f"hydra.run.dir={tmp_path}"],
        cwd=REPO, env={**os.environ, "RAY_TMPDIR": ray_dir}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # SIGINT as a terminal's foreground server has it: pytest started in the background by a
        # script ignores it, and its children would inherit that (a serve.py that never stops).
        start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        with ThreadPoolExecutor(1) as client:
            # A long call in flight when Ctrl-C comes, which a terminal sends to Ray's processes too.
            in_flight = client.submit(generate, f"http://127.0.0.1:{port}", {"prompt": PROMPTS[0], "steps": 300},
                                      headers={})
            time.sleep(2)
            os.killpg(server.pid, signal.SIGINT)
            out, err = server.communicate(timeout=90)
            response = in_flight.result()
    finally:
        if server.poll() is None:
            server.kill()
    assert response.status_code == 200 and len(pixels_of(response)) == 1
    assert server.returncode == 130, err[-2000:]
    assert "serving model=scenes_sdxl at http://127.0.0.1:" in out
    assert err.strip().splitlines()[-1] == "stopped serving model=scenes_sdxl: 1 of the 1 requests held answered"
    left = [process.pid for process in psutil.process_iter(["cmdline"])
            if any(ray_dir in part for part in process.info["cmdline"] or [])]
    assert not left, f"Ray processes left behind: {left}"
