"""Ctrl-C: every script, interrupted by a real SIGINT while it works, prints one line naming what it
was doing and what it kept, exits with 130, and leaves nothing half-written. Each script is held at
a fixed point of its work when the signal is sent, so the outcome is the same on any machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sdquant.cli import EXIT_INTERRUPTED
from sdquant.load import ensure_tiny_model
from sdquant.workflow.export_trt import run_export

from conftest import REPO, compose_config

SCENES_EXPORT = ["model=scenes_sdxl", "device=cpu", "infer.width=64", "infer.height=64", "infer.batch_size=1",
                 "trt.max_batch_size=2"]


@pytest.fixture
def tiny_sdxl(model_cache):
    """The tiny model built before the script starts, so that building it is no part of what it keeps."""
    ensure_tiny_model(compose_config("sd_xl_quantize", ["model=tiny_sdxl"]).model)


def _interrupted(tmp_path: Path, script: str, overrides: list[str], stage: str, function: str):
    """Runs `script`, held inside `stage` at the first call of `function` (tests/pause_in_stage.py),
    and sends it SIGINT there; returns its exit code and output lines. Where the interrupt lands is
    fixed, so neither a fast nor a slow machine changes what the script does with it."""
    # SIGINT as a terminal leaves it, whatever the shell that started the tests did with it.
    process = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "pause_in_stage.py"), stage, function, str(REPO / script),
         *overrides, f"hydra.run.dir={tmp_path / 'hydra'}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        env=dict(os.environ, PYTHONUNBUFFERED="1"), preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines, paused = [], False
    for line in process.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith(f"paused in {stage} at {function}"):
            paused = True
            process.send_signal(signal.SIGINT)
            break
    rest, _ = process.communicate(timeout=300)
    lines += rest.splitlines()
    assert paused, f"never reached {function} in {stage}:\n" + "\n".join(lines)
    return process.returncode, lines


def _check(code: int, lines: list[str], stage: str) -> str:
    """The exit code and the one line; returns that line."""
    output = "\n".join(lines)
    assert code == EXIT_INTERRUPTED, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    assert lines[-1].startswith(f"interrupted during {stage}; nothing written for it"), output
    return lines[-1]


def _partial(folder: Path) -> list[Path]:
    """Temporary files and folders left behind (artifacts are written under .<name>.*.partial)."""
    return [path for path in folder.rglob("*") if path.name.endswith(".partial")]


def test_quantize(tmp_path, tiny_sdxl):
    out = tmp_path / "quantized"
    code, lines = _interrupted(tmp_path, "quantize.py", [
        "model=tiny_sdxl", f"out_dir={out}", "device=cpu", "quantize.n_steps=4", "quantize.calib_size=4",
        "quantize.batch_size=2"], "calibration", "update_all")
    assert _check(code, lines, "calibration") == "interrupted during calibration; nothing written for it"
    assert not out.exists()


def test_export_trt_in_the_export_and_in_the_build(tmp_path):
    out = tmp_path / "export"
    # Held while the graph is traced, its staging folder already made.
    code, lines = _interrupted(tmp_path, "export_trt.py", [*SCENES_EXPORT, f"infer.out_path={out}"],
                               "exporting unet_xl", "_trace")
    line = _check(code, lines, "exporting unet_xl")
    assert all(str(out / "onnx" / name) in line for name in ("clip1", "clip2", "vae")), line
    assert sorted(p.name for p in (out / "onnx").iterdir()) == ["clip1", "clip2", "vae"], "no staging folder left"

    cfg = compose_config("sd_xl_export", [*SCENES_EXPORT, f"infer.out_path={out}", "run_trt_export=false"])
    assert len(run_export(cfg)) == 4, "what was kept is reused, the UNet exported"

    # Held inside TensorRT's build, at its progress monitor's first step.
    code, lines = _interrupted(tmp_path, "export_trt.py", [*SCENES_EXPORT, f"infer.out_path={out}",
                                                           "run_onnx_export=false"], "building unet_xl.plan",
                               "step_complete")
    line = _check(code, lines, "building unet_xl.plan")
    plans = out / "plan"
    assert str(plans / "clip1.plan") in line and str(plans / "engines.json") in line
    assert not (plans / "unet_xl.plan").exists() and not _partial(out)
    assert set(json.loads((plans / "engines.json").read_text())) == {"clip1", "clip2", "vae"}, \
        "the engines built before it are recorded, so the next run reuses them"


def test_infer_trt(tmp_path, tiny_sdxl):
    out = tmp_path / "images"
    code, lines = _interrupted(tmp_path, "infer_trt.py", [
        "model=tiny_sdxl", "backend=torch", "device=cpu", f"out_path={out}", 'sampling.prompts=["a cat","a dog"]',
        "sampling.steps=4", "sampling.width=64", "sampling.height=64"], "prompt batch 2 of 2", "scale_model_input")
    line = _check(code, lines, "prompt batch 2 of 2")
    assert line.endswith(f"kept what was finished before it: {out / 'image_000_00.png'}")
    assert sorted(p.name for p in out.iterdir()) == ["image_000_00.png"]


def test_evaluate(tmp_path, tiny_sdxl):
    out = tmp_path / "quality"
    code, lines = _interrupted(tmp_path, "evaluate.py", [
        "model=tiny_sdxl", "device=cpu", f"out_path={out}", "+variants.same=null", 'sampling.prompts=["a cat"]',
        "sampling.steps=4", "sampling.width=64", "sampling.height=64"], "the runs of variant same",
        "scale_model_input")
    _check(code, lines, "the runs of variant same")
    assert not out.exists()


def test_train_scene_model(tmp_path):
    out = tmp_path / "scenes"
    code, lines = _interrupted(tmp_path, "tools/train_scene_model.py", [
        "device=cpu", f"out_dir={out}", "dataset_size=32", "vae.steps=4", "vae.batch_size=4",
        "architecture.vae_channels=[32,32,32]", "architecture.vae_layers=1"], "the VAE's training", "_every")
    _check(code, lines, "the VAE's training")
    assert not out.exists() and not _partial(tmp_path)
