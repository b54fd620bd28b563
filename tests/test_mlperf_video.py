"""benchmarks/mlperf_video.py on tiny_wan: LoadGen's Offline and SingleStream over the pipeline built
once, every video from the one latent given (each what the API draws from it), and the inputs it
refuses in one line before any video."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sdquant.api import load

REPO = Path(__file__).resolve().parents[1]
SETTINGS = ["backend=torch", "device=cpu", "sampling.steps=4"]
PROMPTS = ["a red fox runs through the snow", "a paper boat on a pond", "a kite over a beach"]


def _harness(tmp_path, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "mlperf_video.py"), "--model", "tiny_wan",
                           "--set", " ".join(SETTINGS), "--prompts", str(tmp_path / "prompts.txt"), *arguments],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def latent_and_checksums(tmp_path_factory, model_cache):
    """A latent file of tiny_wan's geometry, and the checksum of each prompt's video from it."""
    folder = tmp_path_factory.mktemp("mlperf_video")
    (folder / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    with load("tiny_wan", SETTINGS) as pipeline:
        settings = [pipeline.settle([prompt]) for prompt in PROMPTS]
        # In bf16, as MLPerf's fixed latent is stored.
        latent = torch.randn(pipeline.flow.latent_shape(settings[0]), generator=torch.Generator().manual_seed(3))
        latent = latent.to(torch.bfloat16)
        checksums = [float(pipeline.run(each, progress=False, latents=latent.float()).samples.double().sum())
                     for each in settings]
    torch.save(latent, folder / "latent.pt")
    return folder, checksums


# SingleStream warms up on two of the four steps: the timed videos still compile nothing.
@pytest.mark.parametrize("scenario, warm_steps", [("offline", 0), ("singlestream", 2)])
def test_loadgen_runs_every_prompt_from_the_one_latent(latent_and_checksums, scenario, warm_steps):
    folder, checksums = latent_and_checksums
    out = folder / f"{scenario}.json"
    result = _harness(folder, "--count", "3", "--latent", str(folder / "latent.pt"), "--scenario", scenario,
                      "--warm-steps", str(warm_steps), "--out", str(out))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    run = json.loads(out.read_text())["runs"][0]
    assert len(json.loads(out.read_text())["code"]) == 12
    assert run["scenario"] == scenario and run["videos"] >= 3 and run["nonfinite_values"] == 0
    assert run["graphs_compiled_while_timed"] == 0 and run["loadgen"]["Min queries satisfied"] == "Yes"
    assert run["warm_up_steps"] == (warm_steps or 4)
    assert run["gpu_s_per_video"] == pytest.approx(1 / run["videos_per_s"]) and run["p90_s"] > 0
    # Each video is the one the API draws for its prompt from that latent.
    for video in run["per_video"]:
        assert video["checksum"] == pytest.approx(checksums[video["prompt"]], rel=1e-6)
    # Offline issues each sample once; SingleStream draws its samples at random.
    drawn = {video["prompt"] for video in run["per_video"]}
    assert drawn == {0, 1, 2} if scenario == "offline" else drawn <= {0, 1, 2}
    assert f"{scenario}: " in result.stdout and "GPU-s a video" in result.stdout
    assert sum(line.startswith("video ") for line in result.stdout.splitlines()) == run["videos"]


@pytest.mark.parametrize("arguments, message", [
    (["--count", "0"], "--count 0: give how many prompts"),
    (["--warm-steps", "-1"], "--warm-steps -1: give a number of steps"),
    (["--model", "tiny_sdxl"], "--model tiny_sdxl draws images: give a video model"),
    (["--count", "5"], "holds 3 prompts"),
    (["--latent", "missing.pt"], "--latent missing.pt: no such file"),
    (["--count", "3", "--latent", "{folder}/prompts.txt"], "not a tensor torch.load reads"),
    (["--count", "3", "--latent", "{folder}/wrong.pt"],
     "holds (1, 16, 2, 4, 4); this run's videos start from (1, 16, 3, 4, 4)"),
])
def test_bad_inputs_are_refused_in_one_line_before_any_video(latent_and_checksums, arguments, message):
    folder, _ = latent_and_checksums
    torch.save(torch.zeros(1, 16, 2, 4, 4), folder / "wrong.pt")
    out = folder / "refused.json"
    result = _harness(folder, *[argument.format(folder=folder) for argument in arguments], "--out", str(out))
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not out.exists()


@pytest.mark.parametrize("arguments, message", [
    (["--mlperf", "5"], "--mlperf 5: {eval_prompts} holds 4 prompts: give --mlperf-prompts with as many"),
    (["--mlperf", "2", "--mlperf-prompts", "missing.txt"], "--mlperf-prompts missing.txt: no such file"),
])
def test_full_size_mlperf_refuses_too_few_prompts_before_building(tmp_path, arguments, message):
    from sdquant.load import builtin_prompts_path

    out = tmp_path / "refused.json"
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "wan_full_size.py"), "--variants", "fp8_l4",
                             "--whole", "--tiny", *arguments, "--out", str(out)],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert message.format(eval_prompts=builtin_prompts_path("eval_prompts.txt")) in result.stderr, result.stderr
    assert not out.exists()
