"""A GEGLU layer's FP8 GEMM, its gating and the next GEMM's FP8 input rounding as one op,
``torch.ops.sdquant.fp8_geglu``, and the layer that calls it in place of diffusers' GEGLU (the
feed-forward layers of SDXL and SD 1.5) where both GEMMs around it run in FP8.

Why: between a GEGLU feed-forward layer's two GEMMs lies its widest activation, 8x the model's width
in 16 bits, which cuBLAS's GEMM writes and a pointwise kernel reads back only to write a quarter as many
bytes in FP8. In the FP8 SDXL UNet at 16 samples those pointwise kernels took 13.6 ms of a
164 ms call (H100, benchmarks/results/sdxl_gn_form_h100_b8.json). The op's kernel
(sdquant.runtime.kernels.fp8_geglu_triton) gates its fp32 sums and writes FP8 only: 32.0 ms a UNet
call where the GEMMs and gating kernels had taken about 39.7 in the pipeline, with 140 fewer
launches (benchmarks/results/sdxl_gelu_h100_b8.json; docs/speed.md). The ungated tanh-GELU layers of Flux, SD3.5 and
Wan2.2 stay as they are: against cuBLAS's GEMM and the compiled GELU the same kernel, ungated,
gained at most 1.17x there (Flux) and lost at SD3.5's text tokens (0.86x) and at Wan2.2's 75,600
tokens (0.92x; benchmarks/results/fp8_projection_all_shapes_h200.json).

On the CPU the op runs its twin: the dequantized GEMM in the model's precision, the gating and the
rounding, which is what the unfused FP8 layers compute (each Fp8Linear's own twin) and what the GPU
tests hold the kernel against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .exact import KeepsExactTensors
from .fp8 import to_fp8
from .fp8_layers import Fp8Linear

# The kernel reads its operands as TMA boxes: Hopper or newer, rows of whole 16-byte units.
TMA_CAPABILITY = (9, 0)
TMA_ALIGNMENT = 16


def reference_fp8_geglu(x: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor,
                        bias: torch.Tensor | None, out_inverse_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8_geglu's twin in plain torch, on any device: the GEMM of dequantized values in `dtype`, its
    first half times the GELU of its second, rounded to FP8."""
    out = F.linear((x.float() * x_scale).to(dtype), (weight.float() * weight_scale).to(dtype),
                   None if bias is None else bias.to(dtype))
    value, gate = out.chunk(2, dim=-1)
    return to_fp8(value * F.gelu(gate), out_inverse_scale)


def _output(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.empty((x.shape[0], weight.shape[0] // 2), dtype=torch.float8_e4m3fn, device=x.device)


@torch.library.custom_op("sdquant::fp8_geglu", mutates_args=(), device_types="cpu")
def fp8_geglu(x: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor,
              bias: torch.Tensor | None, out_inverse_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """GEGLU of FP8 `x` (tokens, in features) times FP8 `weight` (2 x features, in features), each with
    its scale (amax / 448), plus `bias`: the first half of the features times the GELU of the second,
    in FP8, rounded with `out_inverse_scale` (448 / the next layer's input amax). `dtype`: the
    model's precision, which the twin computes in."""
    return reference_fp8_geglu(x, weight, x_scale, weight_scale, bias, out_inverse_scale, dtype)


@fp8_geglu.register_fake
def _(x, weight, x_scale, weight_scale, bias, out_inverse_scale, dtype):
    return _output(x, weight)


@fp8_geglu.register_kernel("cuda")
def _(x, weight, x_scale, weight_scale, bias, out_inverse_scale, dtype):
    # Imported here: Triton is only needed where the op runs on a GPU.
    from .fp8_geglu_triton import triton_geglu

    return triton_geglu(x, weight, x_scale, weight_scale, bias, out_inverse_scale, _output(x, weight))


class Fp8Geglu(KeepsExactTensors, torch.nn.Module):
    """A GEGLU layer whose projection is an FP8 GEMM, as one op whose FP8 output the next FP8 layer
    (`reader`) takes as it is."""

    exact = ("weight_fp8", "weight_scale", "input_scale", "input_inverse_scale", "out_inverse_scale")

    def __init__(self, projection: Fp8Linear, reader: Fp8Linear):
        super().__init__()
        for name in ("weight_fp8", "weight_scale", "input_scale", "input_inverse_scale", "bias"):
            self.register_buffer(name, getattr(projection, name))
        self.register_buffer("out_inverse_scale", reader.input_inverse_scale.clone())
        self.in_features, self.dtype = projection.in_features, projection.out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = to_fp8(x.reshape(-1, self.in_features), self.input_inverse_scale)
        out = fp8_geglu(rows, self.weight_fp8, self.input_scale, self.weight_scale, self.bias, self.out_inverse_scale,
                        self.dtype)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _reader(feed_forward) -> torch.nn.Module | None:
    """The layer after the activation: dropouts, identities at inference, are skipped."""
    return next((layer for layer in list(feed_forward.net)[1:] if not isinstance(layer, torch.nn.Dropout)), None)


def _kernel_takes(projection: Fp8Linear) -> bool:
    device = projection.weight_fp8.device
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < TMA_CAPABILITY:
        return False
    return projection.in_features % TMA_ALIGNMENT == 0


def fuse_geglus(backbone: torch.nn.Module) -> int:
    """Gives every diffusers GEGLU feed-forward layer of `backbone` whose projection and next layer
    run on FP8 GEMMs (Fp8Linear) the fused op, in place; returns how many. On a GPU without TMA
    (before Hopper) they stay as they are."""
    from diffusers.models.activations import GEGLU
    from diffusers.models.attention import FeedForward

    fused = 0
    for feed_forward in backbone.modules():
        if not isinstance(feed_forward, FeedForward) or type(feed_forward.net[0]) is not GEGLU:
            continue
        projection, reader = feed_forward.net[0].proj, _reader(feed_forward)
        if isinstance(projection, Fp8Linear) and isinstance(reader, Fp8Linear) and _kernel_takes(projection):
            feed_forward.net[0] = Fp8Geglu(projection, reader)
            fused += 1
    return fused
