"""The README's one-command demo runs the whole workflow on the tiny model."""

from __future__ import annotations

import json
import os
import subprocess

from conftest import REPO


def test_demo_runs_quantize_export_build_infer_and_evaluate(model_cache, tmp_path):
    result = subprocess.run(["bash", str(REPO / "demo_tiny.sh")], cwd=tmp_path, capture_output=True, text=True,
                            env=dict(os.environ), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    [checkpoint] = (tmp_path / "quantized").glob("nemo_tiny_sdxl_int8_l3_a0.8_min-mean_p1_s4_c4_b1_seed42_*")
    assert (checkpoint / "unet.mto").is_file()
    engines = json.loads((tmp_path / "sdxl_export/plan/engines.json").read_text())
    assert set(engines) == {"clip1", "clip2", "unet_xl", "vae"}
    assert (tmp_path / "trt_output/image_000_00.png").is_file()
    latency = json.loads((tmp_path / "trt_output/latency.json").read_text())
    assert latency["ms"]["end_to_end"] > 0
    quality = json.loads((tmp_path / "quality/quality.json").read_text())
    assert set(quality["variants"]) == {"int8", "int8_onnx"}
    for script in ("quantize", "ONNX export", "TensorRT build", "inference", "quality evaluation"):
        assert f"{script} finished in" in result.stdout
    # The build loaded TensorRT for RTX, and its summary says so.
    assert "tensorrt_rtx 1." in result.stdout.split("TensorRT build finished in")[1].split("\n\n")[0]
