"""The fused FP8 GEGLU's Triton kernel (torch.ops.sdquant.fp8_geglu on CUDA) against its twin
(sdquant.runtime.kernels.fp8_geglu, run on the same GPU tensors): with every tile the autotuner may
pick, at shapes that overhang the tiles, and on every GEGLU layer of the converted SDXL scene model
on its own input. Skipped before Hopper (the kernel reads TMA boxes).

    python -m pytest -m gpu tests/test_fp8_geglu_gpu.py -n 0 -s

Both give FP8. The kernel gates its fp32 sums, the twin the GEMM rounded to fp16, so values that lie
near an FP8 rounding boundary round to neighbouring FP8 values: 3-4% of them at SDXL's shapes,
as many as the unfused cuBLAS GEMM and compiled gating kernel part from the twin (H200,
benchmarks/results/fp8_geglu_h200.json), under 1% of the output's norm. A wrong strip, half or
scale is off by the size of the output.
"""

from __future__ import annotations

import pytest
import torch

from sdquant.runtime.kernels.fp8 import fp8_scales, to_fp8
from sdquant.runtime.kernels.fp8_geglu import TMA_CAPABILITY, Fp8Geglu, fuse_geglus, reference_fp8_geglu

from test_conv8_gpu import converted_scene_inputs, level3  # noqa: F401  (level3: a fixture)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none is visible here)")]

CUDA = torch.device("cuda")
TWIN_BOUND = 3e-2
FLIPPED_BOUND = 0.1


def _needs_hopper() -> None:
    if torch.cuda.get_device_capability(CUDA) < TMA_CAPABILITY:
        pytest.skip("the fused GEGLU reads TMA boxes: Hopper or newer")


def _compare(args: tuple, what: str) -> int:
    """Holds the kernel's output against the twin's; returns how many of the twin's values saturate
    (the kernel relies on the FP8 conversion for that)."""
    got = torch.ops.sdquant.fp8_geglu(*args, torch.float16)
    twin = reference_fp8_geglu(*args, torch.float16)
    assert got.shape == twin.shape and got.dtype == torch.float8_e4m3fn, what
    error = float((got.float() - twin.float()).norm() / twin.float().norm())
    flipped = float((got.float() != twin.float()).float().mean())
    print(f"{what}: kernel against twin {error:.1e}, {flipped:.3f} of the values on another FP8 value")
    assert error < TWIN_BOUND and flipped < FLIPPED_BOUND, what
    # The kernel leaves saturation to the FP8 conversion: where the twin clamps, so must it (but
    # for values at the rounding boundary below 448, as anywhere).
    saturated = twin.float().abs() == 448
    if saturated.any():
        assert float((got.float()[saturated] == twin.float()[saturated]).float().mean()) > 1 - FLIPPED_BOUND, what
    return int(saturated.sum())


def _random_case(tokens: int, in_features: int, features: int, bias: bool, seed: int) -> tuple:
    generator = torch.Generator(CUDA).manual_seed(seed)
    x = torch.randn(tokens, in_features, device=CUDA, generator=generator)
    weight = torch.randn(2 * features, in_features, device=CUDA, generator=generator) / in_features ** 0.5
    (x_inverse, x_scale), (w_inverse, w_scale) = fp8_scales(x.abs().amax()), fp8_scales(weight.abs().amax())
    bias_values = torch.randn(2 * features, device=CUDA, generator=generator).half() * 0.1 if bias else None
    out_inverse, _ = fp8_scales(torch.tensor(3.0, device=CUDA))
    return to_fp8(x, x_inverse), to_fp8(weight, w_inverse), x_scale, w_scale, bias_values, out_inverse


# (tokens, in features, features after the gating, bias): SDXL's two widths at a small image, and
# tokens, features and input strips that overhang every tile.
SHAPES = [(1024, 320, 1280, True), (512, 640, 2560, False), (300, 336, 200, True)]


def _tiles():
    from sdquant.runtime.kernels import fp8_geglu_triton as kernels

    return kernels.TILES


@pytest.mark.parametrize("tile", _tiles(), ids=[str(tile) for tile in _tiles()])
def test_every_tile_matches_the_twin(tile):
    """The autotuner picks a tile per shape by speed alone: each must be right on every shape."""
    from sdquant.runtime.kernels import fp8_geglu_triton as kernels

    _needs_hopper()
    configs, cache = kernels.geglu.configs, kernels.geglu.cache
    kernels.geglu.configs, kernels.geglu.cache = kernels._configs((tile,)), {}
    try:
        saturated = sum(_compare(_random_case(*shape, seed=seed), f"{tile} {shape}")
                        for seed, shape in enumerate(SHAPES))
        assert saturated > 0, "no case reaches the FP8 range's end: the saturation went untested"
    finally:
        kernels.geglu.configs, kernels.geglu.cache = configs, cache


def test_every_scene_geglu_matches_its_twin_on_its_own_input(level3):  # noqa: F811
    _needs_hopper()
    fused = []
    seen = converted_scene_inputs(level3("fp8"), "fp8", Fp8Geglu, then=lambda unet: fused.append(fuse_geglus(unet)))
    assert fused[0] == len(seen) > 0
    with torch.no_grad():
        for name, (module, x) in seen.items():
            rows = to_fp8(x.reshape(-1, module.in_features), module.input_inverse_scale)
            _compare((rows, module.weight_fp8, module.input_scale, module.weight_scale, module.bias,
                      module.out_inverse_scale), f"{name} {tuple(x.shape)}")
