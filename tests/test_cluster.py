"""Cluster runs: sweeps through the submitit launchers (a real one-node Slurm cluster in CI),
data-parallel calibration under torchrun, and one job running quantize -> export -> build."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from sdquant import parallel
from sdquant.errors import EXIT_USER_ERROR, UserError

from conftest import FAST_QUANTIZE, REPO

TINY = ["model=tiny_sdxl", "device=cpu", "quantize.quant_level=3"]


def _slurm_answers() -> bool:
    if shutil.which("sinfo") is None:
        return False
    result = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30)
    return result.returncode == 0 and any(state in result.stdout for state in ("idle", "mix"))


# CI starts a cluster (.ci/slurm_up.sh) and sets SDQUANT_REQUIRE_SLURM=1, so there the test cannot skip.
requires_slurm = pytest.mark.skipif(
    not _slurm_answers() and not os.environ.get("SDQUANT_REQUIRE_SLURM"),
    reason="no Slurm cluster answers here: `sudo bash .ci/slurm_up.sh` starts a one-node one")


def _sidecars(folder):
    return [json.loads(path.read_text()) for path in sorted(folder.glob("*/checkpoint.json"))]


def _sweep(run_script, tmp_path, *launcher):
    result = run_script("quantize.py", "-m", *TINY, *FAST_QUANTIZE, "quantize.alpha=0.5,1.0",
                        f"out_dir={tmp_path / 'q'}", f"hydra.sweep.dir={tmp_path / 'sweep'}", *launcher)
    assert result.returncode == 0, result.stderr[-3000:]
    sidecars = _sidecars(tmp_path / "q")
    assert sorted(s["settings"]["quantize"]["alpha"] for s in sidecars) == [0.5, 1.0]
    assert len({s["fingerprint"] for s in sidecars}) == 2
    return sidecars


@requires_slurm
def test_sweep_runs_one_slurm_job_per_combination(run_script, tmp_path):
    sidecars = _sweep(run_script, tmp_path, "hydra/launcher=slurm", "hydra.launcher.partition=debug",
                      "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1",
                      "hydra.launcher.mem_gb=3", "hydra.launcher.timeout_min=15")
    job_ids = [s["job"]["slurm_job_id"] for s in sidecars]
    assert all(job_ids) and len(set(job_ids)) == 2, job_ids


def test_sweep_runs_as_local_submitit_jobs(run_script, tmp_path):
    sidecars = _sweep(run_script, tmp_path, "hydra/launcher=local", "hydra.launcher.cpus_per_task=1")
    assert all(s["job"]["slurm_job_id"] is None for s in sidecars)
    assert (tmp_path / "sweep" / ".submitit").is_dir()


def _quantizer_state(folder) -> dict[str, torch.Tensor]:
    [checkpoint] = folder.glob("*/unet.mto")
    state = torch.load(checkpoint, weights_only=False, map_location="cpu")["model_state_dict"]
    return {key: value for key, value in state.items() if "quantizer" in key or key.endswith("weight")}


@pytest.mark.parametrize("method", ["min-mean", "global_min"])
def test_two_process_calibration_equals_one_process_exactly(model_cache, tmp_path, method):
    # CPU kernels sum in an order that depends on the thread count, and torchrun gives each process
    # one thread: the one-process run gets one too, so both see bit-identical activations.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    settings = [*TINY, "quantize.n_steps=4", "quantize.calib_size=4", "quantize.batch_size=1",
                f"quantize.collect_method={method}"]
    one = subprocess.run([sys.executable, "quantize.py", *settings, f"out_dir={tmp_path / 'one'}",
                          f"hydra.run.dir={tmp_path / 'h1'}"], cwd=REPO, env=env, capture_output=True, text=True)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "quantize.py", *settings, f"out_dir={tmp_path / 'two'}", f"hydra.run.dir={tmp_path / 'h2'}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    [single], [split] = _sidecars(tmp_path / "one"), _sidecars(tmp_path / "two")
    assert split["job"]["processes"] == 2 and single["job"]["processes"] == 1
    assert split["calibration"]["batches"] == single["calibration"]["batches"] == 4
    assert split["calibration"]["backbone_calls"] == single["calibration"]["backbone_calls"]
    expected, got = _quantizer_state(tmp_path / "one"), _quantizer_state(tmp_path / "two")
    smoothing = [key for key in expected if key.endswith("_pre_quant_scale")]
    amax = [key for key in expected if key.endswith("input_quantizer._amax")]
    assert len(smoothing) > 50 and len(amax) > 100
    assert expected.keys() == got.keys()
    assert [key for key in expected if not torch.equal(expected[key], got[key])] == []


def test_more_processes_than_batches_is_refused():
    with pytest.raises(UserError, match="3 calibration batches .* cannot be split over 4 processes"):
        parallel.shard([["a"], ["b"], ["c"]], parallel.World(rank=0, size=4))
    shards = [parallel.shard([["a"], ["b"], ["c"]], parallel.World(rank=r, size=2)) for r in (0, 1)]
    assert shards == [[(0, ["a"]), (2, ["c"])], [(1, ["b"])]]


def test_one_job_quantizes_exports_and_builds_then_reuses_all(run_script, tmp_path):
    chain = [*TINY, *FAST_QUANTIZE, f"out_dir={tmp_path / 'q'}", "run_onnx_export=true", "run_trt_export=true",
             "infer.width=64", "infer.height=64"]
    first = run_script("quantize.py", *chain)
    assert first.returncode == 0, first.stderr[-3000:]
    [folder] = (tmp_path / "q").iterdir()
    engines = json.loads((folder / "sdxl_export" / "plan" / "engines.json").read_text())
    assert set(engines) == {"clip1", "clip2", "unet_xl", "vae"}
    for step in ("quantize", "ONNX export", "TensorRT build"):
        assert f"{step} finished in" in first.stdout

    again = run_script("quantize.py", *chain, "run_quantization=false")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "wrote" not in again.stdout and again.stdout.count("reused") == 1 + 4 + 4


def test_run_quantization_false_without_a_checkpoint_is_refused(run_script, tmp_path):
    result = run_script("quantize.py", *TINY, *FAST_QUANTIZE, f"out_dir={tmp_path / 'q'}", "run_quantization=false",
                        "run_onnx_export=true")
    assert result.returncode == EXIT_USER_ERROR
    assert "run_quantization=false but" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "q").exists()
