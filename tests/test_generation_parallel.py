"""Generation spread over processes: torchrun ranks and independent jobs (Slurm array tasks) each
take their share of the prompt batches, and together they make the one-process run's images."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
from PIL import Image

from sdquant.workflow.infer_trt import run_infer

from conftest import REPO, compose_config

PROMPTS = ["a red circle on the left and a blue square on the right, white background",
           "a small blue circle on the left, pink background", "a large green square at the top, black background",
           "a yellow triangle at the top and an orange circle at the bottom, gray background",
           "a small purple triangle in the centre, white background"]
SETTINGS = ["model=scenes_sdxl", "backend=torch", "device=cpu", f"sampling.prompts={json.dumps(PROMPTS)}",
            "sampling.steps=6", "sampling.num_images_per_prompt=2", "num_warmup_runs=0"]


def _pixels(folder) -> dict[str, np.ndarray]:
    return {path.name: np.asarray(Image.open(path)) for path in sorted(folder.glob("*.png"))}


def _seeds(folder) -> dict[str, str]:
    return {path.name: Image.open(path).text["seed"] for path in sorted(folder.glob("*.png"))}


def _in_one_and_two_processes(script: str, settings: list[str], tmp_path) -> subprocess.CompletedProcess:
    """Runs `script` as one process into tmp_path/one and as two torchrun processes into
    tmp_path/two; returns the torchrun."""
    # One thread each, as torchrun gives its processes: CPU kernels then sum in one order.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launchers = {"one": [], "two": ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]}
    for name, launcher in launchers.items():
        result = subprocess.run([sys.executable, *launcher, script, *settings, f"out_path={tmp_path / name}",
                                 f"hydra.run.dir={tmp_path / ('h' + name)}"], cwd=REPO, env=env, capture_output=True,
                                text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def _check_rate_after_first_batch(latency: dict) -> None:
    """After its first batch (which compiles or sets up), each part counts its later batches:
    of five batches of two images, parts of three and two batches count four and two images, made
    side by side in the slower part's time."""
    parts = [part["after_first_batch"] for part in latency["parts"]]
    assert sorted(part["images"] for part in parts) == [2, 4]
    merged = latency["after_first_batch"]
    assert merged["images"] == 6 and merged["seconds"] == max(part["seconds"] for part in parts)
    assert merged["images_per_second"] == 6 / merged["seconds"]


def test_two_torchrun_ranks_make_the_one_process_images_and_one_report(tmp_path):
    two = _in_one_and_two_processes("infer_trt.py", SETTINGS, tmp_path)
    single, split = _pixels(tmp_path / "one"), _pixels(tmp_path / "two")
    assert len(single) == 10 and single.keys() == split.keys()
    assert all(np.array_equal(single[name], split[name]) for name in single)
    assert _seeds(tmp_path / "one") == _seeds(tmp_path / "two")
    latency = json.loads((tmp_path / "two" / "latency.json").read_text())
    assert len(latency["parts"]) == 2 and latency["images_written"] == 10
    assert latency["images_per_second"] == sum(part["images_per_second"] for part in latency["parts"])
    _check_rate_after_first_batch(latency)
    assert two.stdout.count("inference finished in") == 1, "one summary, from rank 0"


def test_shard_jobs_make_the_one_process_images_and_the_last_merges_the_report(tmp_path):
    run_infer(compose_config("sd_xl_trt_inference", [*SETTINGS, f"out_path={tmp_path / 'one'}"]))
    for index in (1, 0):
        run_infer(compose_config("sd_xl_trt_inference", [*SETTINGS, f"out_path={tmp_path / 'jobs'}",
                                                         f"shard.index={index}", "shard.count=2"]))
        merged = tmp_path / "jobs" / "latency.json"
        assert merged.is_file() == (index == 0), "merged once both jobs are done"
    single, jobs = _pixels(tmp_path / "one"), _pixels(tmp_path / "jobs")
    assert single.keys() == jobs.keys() and all(np.array_equal(single[name], jobs[name]) for name in single)
    latency = json.loads(merged.read_text())
    assert latency["shards"] == 2 and latency["images_written"] == 10 and len(latency["parts"]) == 2
    _check_rate_after_first_batch(latency)


EVALUATE = ["model=scenes_sdxl", "device=cpu", f"sampling.prompts={json.dumps(PROMPTS)}", "sampling.steps=6",
            "+variants.cached=null", "+variant_cache={cached:{method:deepcache,interval:3}}"]


def _quality(folder) -> tuple[dict, np.ndarray]:
    result = json.loads((folder / "quality.json").read_text())
    return result, np.asarray(Image.open(folder / "grid.png"))


def test_evaluate_over_torchrun_ranks_and_shard_jobs_writes_the_one_process_report(tmp_path):
    from sdquant.workflow.evaluate import run_evaluate

    _in_one_and_two_processes("evaluate.py", EVALUATE, tmp_path)
    for index in (0, 1):
        run_evaluate(compose_config("sd_xl_evaluate", [*EVALUATE, f"out_path={tmp_path / 'jobs'}",
                                                       f"shard.index={index}", "shard.count=2"]))
    (single, single_grid), (split, split_grid), (jobs, jobs_grid) = (_quality(tmp_path / name)
                                                                     for name in ("one", "two", "jobs"))
    for other in (split, jobs):
        assert other["variants"] == single["variants"] and other["adherence"] == single["adherence"]
    assert np.array_equal(single_grid, split_grid) and np.array_equal(single_grid, jobs_grid)
    assert len(single["variants"]["cached"]["per_prompt"]) == 5
