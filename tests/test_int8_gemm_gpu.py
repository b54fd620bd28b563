"""torch_backend.quantized=int8 on a GPU: the CUDA integer GEMM (torch._int_mm on cuBLAS) against the
same layer on the CPU, and the INT8 UNet compiled and replayed as CUDA graphs against its eager
run. Skipped without a GPU.

Run on the GPU machine: python -m pytest -m gpu tests/test_int8_gemm_gpu.py
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from sdquant.runtime import torch_backend
from sdquant.runtime.kernels.int8 import Int8Linear
from sdquant.families.sd import SDXL

from test_int8_gemm import _calls, _restored, int8_l3  # noqa: F401 (int8_l3: the checkpoint fixture)
from test_torch_backend import _image, _psnr

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none is visible here)")]


def test_the_cuda_integer_gemm_gives_the_cpu_layers_output(int8_l3):
    fake = _restored(int8_l3)
    real = _restored(int8_l3)
    torch_backend.convert_quantized(real, SDXL, str(int8_l3), "int8")
    linear = [name for name, module in real.named_modules() if isinstance(module, Int8Linear)]
    calls = _calls(fake, linear)
    # The deepest attention layers of an 8x8 latent see 16 rows: the padded GEMM is among them.
    assert min(inputs.reshape(-1, inputs.shape[-1]).shape[0] for inputs, _ in calls.values()) <= 16
    with torch.no_grad():
        for name in linear:
            inputs, fake_output = calls[name]
            on_cpu = real.get_submodule(name)
            on_gpu = copy.deepcopy(on_cpu).cuda()
            # The same integers summed exactly on both, then the same fp32 epilogue.
            expected = on_cpu(inputs)
            assert (on_gpu(inputs.cuda()).cpu() - expected).norm() / expected.norm() < 1e-6, name
            # In fp16, as the torch backend runs on a GPU: the same on both but for the epilogue's
            # float rounding, and within fp16's rounding of the input (a few values move to the next
            # INT8 step: 4e-3 at most on the tiny UNet) of the fake-quant layer in fp32.
            half = on_gpu.half()(inputs.cuda().half()).float().cpu()
            half_on_cpu = copy.deepcopy(on_cpu).half()(inputs.half()).float()
            assert (half - half_on_cpu).norm() / half_on_cpu.norm() < 1e-4, name
            assert (half - fake_output).norm() / fake_output.norm() < 1e-2, name


def test_the_compiled_int8_unet_replayed_as_cuda_graphs_draws_the_eager_image(int8_l3, tmp_path, model_cache):
    quantized = [f"quantized_unet={int8_l3}", "torch_backend.quantized=int8", "device=cuda"]
    eager = _image(tmp_path / "eager", *quantized, model="tiny_sdxl", steps=8)
    fast = _image(tmp_path / "fast", *quantized, "torch_backend.compile=true", "cuda_graph=true",
                  "num_timed_runs=2", model="tiny_sdxl", steps=8)
    print(f"compiled + CUDA graphs against eager: {_psnr(eager, fast):.2f} dB PSNR, "
          f"largest pixel difference {np.abs(fast - eager).max() * 255:.0f}")
    assert _psnr(eager, fast) > 40
