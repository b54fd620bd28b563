"""The compiled forms on a GPU (sdquant.runtime.compiled_forms): with the torch backend's choice of
persistent rows, a 1280-wide residual add + LayerNorm (SDXL's transformer blocks) compiles to one
kernel that keeps each row in registers, where inductor alone writes a looped one, and computes
what eager does. The CPU test (test_torch_backend.py) checks the choice itself; only a GPU's
compile writes Triton reductions. Skipped without a GPU.

    python -m pytest -m gpu tests/test_compiled_forms_gpu.py -n 0
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none is visible here)")]

WIDTH = 1280


def _compiled_code(block, *inputs, choices) -> tuple[torch.Tensor, str]:
    """`block`'s compiled output on `inputs` and the kernels' code, compiled afresh under `choices`
    (no FX graph cache: it does not key on them). Each compile names its choices: the torch
    backend's speed_up, which other tests run, leaves its own installed for the thread."""
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code
    from torch._inductor.virtualized import V

    torch._dynamo.reset()
    with V.set_choices_handler(choices), config.patch(fx_graph_cache=False):
        out, code = run_and_get_code(torch.compile(block), *inputs)
    return out, "\n".join(code)


def test_a_1280_wide_layer_norm_keeps_its_rows_in_registers_with_eagers_values():
    from torch._inductor.choices import InductorChoices

    from sdquant.runtime.compiled_forms import PersistentRows

    norm = torch.nn.LayerNorm(WIDTH, device="cuda", dtype=torch.float16)
    generator = torch.Generator("cuda").manual_seed(0)
    x, residual = (torch.randn(16384, WIDTH, device="cuda", dtype=torch.float16, generator=generator) for _ in range(2))

    def block(x, residual):
        return norm(x + residual)

    with torch.no_grad():
        _, looped = _compiled_code(block, x, residual, choices=InductorChoices())
        out, persistent = _compiled_code(block, x, residual, choices=PersistentRows())
        expected = block(x, residual)
    # Inductor alone loops over such rows: the choice is what changes the kernel.
    assert "triton_red_" in looped and "triton_per_" not in looped
    assert "triton_per_" in persistent and "triton_red_" not in persistent
    # Eager rounds the sum to fp16 before the norm and the compiled kernel keeps it in fp32, so they
    # may part by a few units in the last place (fp16's is 2^-9 to 2^-8 for the values of a unit
    # normal between 2 and 8); a row normalized with wrong statistics would be off by about 1.
    torch.testing.assert_close(out, expected, atol=8e-3, rtol=4e-3)
