"""CUDA-graph replay on a GPU (sdquant.runtime.cuda_graphs), where each user of it captures its own way:
calibration's captured UNet gives the eager run's statistics, the torch backend's graph replay the
eager run's images. Skipped without a GPU.

Run on the GPU machine: python -m pytest -m gpu tests/test_cuda_graphs_gpu.py
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from sdquant.cuda_graphs import CapturedGraph, signature

from conftest import compose_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none is visible here)")]


def test_a_replay_computes_what_the_call_does_on_new_inputs():
    weight = torch.randn(64, 64, device="cuda")
    static = {"x": torch.randn(8, 64, device="cuda")}
    # cuBLAS sets up its handle and workspace on a stream's first call, which a capture cannot
    # record: warm up on a side stream first, as PyTorch's CUDA-graph notes do.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        static["x"] @ weight
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = {"y": static["x"] @ weight}
    captured = CapturedGraph(graph, static, outputs)
    for _ in range(3):
        x = torch.randn(8, 64, device="cuda")
        replayed = captured.replay({"x": x})
        assert torch.allclose(replayed["y"], x @ weight)
        assert replayed["y"].data_ptr() != outputs["y"].data_ptr(), "the caller gets its own copy"
    assert signature({"x": x}) == (("x", (8, 64), torch.float32),)


def test_calibration_through_graphs_records_the_eager_statistics(tmp_path, model_cache):
    from sdquant.workflow.quantize import run_quantize

    sidecars = {}
    for cuda_graph in (True, False):
        folder = run_quantize(compose_config("sd_xl_quantize", [
            "model=tiny_sdxl", f"out_dir={tmp_path / str(cuda_graph)}", "device=cuda", "quantize.n_steps=4",
            "quantize.calib_size=4", "quantize.batch_size=2", "quantize.quant_level=3", f"cuda_graph={cuda_graph}"]))
        sidecars[cuda_graph] = json.loads((folder / "checkpoint.json").read_text())["activation_amax"]
    assert sidecars[True] == sidecars[False]


def test_torch_backend_graph_replay_draws_the_eager_image(tmp_path, model_cache):
    from sdquant.workflow.infer_trt import run_infer

    images = {}
    for cuda_graph in (True, False):
        out = tmp_path / str(cuda_graph)
        run_infer(compose_config("sd_xl_trt_inference", [
            "model=scenes_sdxl", "backend=torch", "device=cuda", f"out_path={out}", f"cuda_graph={cuda_graph}",
            "sampling.prompts=['a small red circle on the left, white background']", "sampling.steps=8",
            "sampling.width=64", "sampling.height=64", "num_timed_runs=2"]))
        images[cuda_graph] = np.asarray(Image.open(out / "image_000_00.png")).astype(np.int16)
    assert np.abs(images[True] - images[False]).max() <= 2


@pytest.mark.parametrize("mode, cuda_graph", [("default", True), ("reduce-overhead", False)])
def test_vae_decoded_in_slices_under_compile_draws_the_whole_batch_images(tmp_path, model_cache, mode, cuda_graph):
    # reduce-overhead replays the compiler's own CUDA graphs, which overwrite a call's outputs on
    # the next call: slices kept by reference would all show the last slice's images.
    from sdquant.workflow.infer_trt import run_infer

    prompts = ["a small red circle on the left, white background", "a large blue square at the top, pink background",
               "a green triangle on the right, white background"]
    images = {}
    for vae_batch in (2, 0):
        out = tmp_path / str(vae_batch)
        run_infer(compose_config("sd_xl_trt_inference", [
            "model=scenes_sdxl", "backend=torch", "device=cuda", f"out_path={out}", "torch_backend.compile=true",
            f"torch_backend.compile_mode={mode}", f"cuda_graph={cuda_graph}", f"torch_backend.vae_batch={vae_batch}",
            f"sampling.prompts={json.dumps(prompts)}", "sampling.batch_size=3", "sampling.steps=4",
            "sampling.width=64", "sampling.height=64", "num_timed_runs=2"]))
        images[vae_batch] = np.stack([np.asarray(Image.open(out / f"image_000_{k:02d}.png")).astype(np.int16)
                                      for k in range(3)])
    assert np.abs(images[2] - images[0]).max() <= 2
