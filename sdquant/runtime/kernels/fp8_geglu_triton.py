"""The Triton kernel of torch.ops.sdquant.fp8_geglu (sdquant.runtime.kernels.fp8_geglu): a GEGLU
layer's FP8 GEMM with the gating and the FP8 rounding of the next GEMM's input in its epilogue, so
that the wide 16-bit projection between them never goes to memory.

Each program computes a tile of output features for a tile of tokens: two sums from the same input
strip, one of the value features (the weight's first half) and one of the gate features (its
second half), read as TMA boxes (the parts past the matrices' ends read as zeros).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .conv8_triton import _ceil_div, _configs as conv_configs, _grouped

# Autotuned tiles: (tokens, output features, input features per step, warps, pipeline stages), each
# tile holding two sums of that size. On an H100 the first won at SDXL's 1280 channels and the
# second at its 640 (0.621 ms against the first's 0.646; with four stages it took 0.964,
# benchmarks/results/fp8_geglu_ablation_h100.json). The third steps 64 input features at a time,
# for widths that 128 does not divide (SD 1.5's 320), where a 128-wide step would sum zeros.
TILES = ((128, 128, 128, 8, 3), (128, 64, 128, 4, 3), (128, 64, 64, 4, 4))

# Constants a jit function reads must be constexpr for Triton's compiler.
SQRT_HALF = tl.constexpr(0.7071067811865476)
LOG2_E = tl.constexpr(1.4426950408889634)


def _configs(tiles):
    return conv_configs(tiles, _set_blocks)


def _set_blocks(args: dict) -> None:
    """Gives the tensor descriptors the boxes of the configuration being run."""
    args["x"].block_shape = [args["BLOCK_M"], args["BLOCK_K"]]
    args["weight"].block_shape = [args["BLOCK_N"], args["BLOCK_K"]]


@triton.jit
def _reciprocal(x, ON_CPU: tl.constexpr):
    # The hardware's approximation (within 1 ulp) instead of a division rounded as IEEE asks, which
    # takes several instructions more: nothing overlaps the epilogue's arithmetic, between a
    # tile's last GEMM step and its store, so each instruction there adds to the kernel's time.
    # Triton's interpreter (the CPU tests) runs no PTX.
    if ON_CPU:
        return 1.0 / x
    else:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)


@triton.jit
def _gelu(x, ON_CPU: tl.constexpr):
    """GELU, x times the normal distribution function, with the error function of Abramowitz and
    Stegun (7.1.26: within 1.5e-7 in exact arithmetic, the size of fp32's own rounding): for
    negative x the function is half the complementary error function, which the formula gives
    without the cancellation of 1 + erf. libdevice's erff, accurate to 2 ulp, took 13-18% of the
    kernel's time at 1280 channels and 23-25% at 640 on an H100; with this form, and no clamp
    before the FP8 conversion, the kernel took 6% and 11% less time, its outputs on the same FP8
    values but for about one in a million (benchmarks/results/fp8_geglu_ablation_h100.json)."""
    z = tl.abs(x) * SQRT_HALF
    t = _reciprocal(1.0 + 0.3275911 * z, ON_CPU)
    tail = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    half_complement = 0.5 * tail * tl.exp2(z * z * -LOG2_E)
    return x * tl.where(x < 0, half_complement, 1.0 - half_complement)


@triton.autotune(configs=_configs(TILES), key=["tokens", "features", "in_features", "HAS_BIAS"])
@triton.jit
def geglu(x, weight, bias, out, x_scale, weight_scale, out_inverse_scale, tokens, features, in_features,
          HAS_BIAS: tl.constexpr, ON_CPU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    row_tile, col_tile = _grouped(tl.program_id(0), _ceil_div(tokens, BLOCK_M), _ceil_div(features, BLOCK_N), GROUP_M)
    row0 = row_tile * BLOCK_M
    col0 = col_tile * BLOCK_N
    value_sums = tl.full((BLOCK_M, BLOCK_N), 0, tl.float32)
    gate_sums = tl.full((BLOCK_M, BLOCK_N), 0, tl.float32)
    for k in range(0, in_features, BLOCK_K):
        strip = x.load([row0, k])
        value_sums = tl.dot(strip, weight.load([col0, k]).T, value_sums)
        gate_sums = tl.dot(strip, weight.load([features + col0, k]).T, gate_sums)
    scale = tl.load(x_scale) * tl.load(weight_scale)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    col_valid = cols < features
    values = value_sums * scale
    gates = gate_sums * scale
    if HAS_BIAS:
        values += tl.load(bias + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
        gates += tl.load(bias + features + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    # No clamp: the conversion to FP8 saturates at +-448 (cvt.rn.satfinite); an fp32 `out` takes
    # the values before it.
    result = values * _gelu(gates, ON_CPU) * tl.load(out_inverse_scale)
    targets = out + rows.to(tl.int64)[:, None] * features + cols[None, :]
    tl.store(targets, result.to(out.dtype.element_ty), mask=(rows < tokens)[:, None] & col_valid[None, :])


def triton_geglu(x, weight, x_scale, weight_scale, bias, out_inverse_scale, out: torch.Tensor) -> torch.Tensor:
    """Into `out` (tokens, features), on `x`'s device (a CPU under TRITON_INTERPRET=1, as the CPU
    tests run it): FP8 `x` (tokens, in features) times FP8 `weight` (2 x features, in features).
    `out` is FP8, or for the CPU tests fp32, which receives the values before their rounding:
    Triton's interpreter rounds to FP8 wrongly at the edges of binades."""
    tokens, in_features = x.shape
    features = out.shape[1]
    # TMA boxes of contiguous rows, their sizes set per configuration (_set_blocks). A box past
    # the value half reads gate rows only for output features the store leaves out.
    x = x.contiguous()
    weight = weight.contiguous()
    x_box = TensorDescriptor(x, list(x.shape), [in_features, 1], [16, 16])
    weight_box = TensorDescriptor(weight, list(weight.shape), [in_features, 1], [16, 16])

    def grid(meta):
        return (triton.cdiv(tokens, meta["BLOCK_M"]) * triton.cdiv(features, meta["BLOCK_N"]),)

    geglu[grid](x_box, weight_box, bias if bias is not None else x_scale, out, x_scale, weight_scale,
                out_inverse_scale, tokens, features, in_features, HAS_BIAS=bias is not None,
                ON_CPU=x.device.type == "cpu")
    return out
