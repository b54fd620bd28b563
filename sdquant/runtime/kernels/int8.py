"""A format=int8 checkpoint's calibrated layers for the torch backend: Linear layers as integer
GEMMs (int8 x int8 -> int32, ``torch._int_mm``), convolutions in the model's precision on
INT8-rounded weights and inputs (torch has no INT8 convolution kernel on GPUs).

Every rounding is ModelOpt's INT8 fake quantization, number for number: in fp32, a tensor times
127 / amax (weights one amax per output channel, activations one per tensor), rounded half to even
and clamped to [-128, 127]; a range under 2**-24 rounds everything to 0. SmoothQuant's per-channel
scale (ModelOpt's pre_quant_scale on the input quantizer) multiplies the input first, in the input's
precision as ModelOpt does; its inverse is already folded into the checkpoint's weights. The GEMM
sums exactly in int32, and one pointwise epilogue applies both scales and the bias, which
torch.compile fuses with the GEMM's output as it fuses the input's rounding into its producer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .exact import KeepsExactTensors

INT8_MAX = 127.0
INT8_MIN = -128.0
# ModelOpt treats a smaller range as zero: fp16's smallest subnormal.
ZERO_RANGE = 1.0 / (1 << 24)
# torch._int_mm on CUDA takes only more than 16 rows (and widths that are multiples of 8, as every
# SDXL and Flux layer's are).
MIN_GEMM_ROWS = 17


def int8_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(127 / amax, the divisor that undoes it) in fp32, as ModelOpt's INT8 quantizer computes them:
    a zero range quantizes with 0 (every value to 0) and dequantizes with 1."""
    amax = amax.detach().float()
    zero = amax <= ZERO_RANGE
    # A tensor over a tensor, as ModelOpt divides: a number over a tensor is computed as the
    # tensor's reciprocal times the number, which can round to another last bit.
    scale = torch.full_like(amax, INT8_MAX) / torch.where(zero, torch.ones_like(amax), amax)
    return torch.where(zero, torch.zeros_like(scale), scale), torch.where(zero, torch.ones_like(scale), scale)


def to_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() * scale).round().clamp(INT8_MIN, INT8_MAX).to(torch.int8)


def fake_int8(x: torch.Tensor, scale: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize, as ModelOpt's INT8 fake quantization does."""
    return (to_int8(x, scale).float() / divisor).to(x.dtype)


class Int8Linear(KeepsExactTensors, torch.nn.Module):
    """A calibrated Linear layer as one integer GEMM, with both scales and the bias in its epilogue."""

    exact = ("input_scale", "output_scale")

    def __init__(self, linear: torch.nn.Linear, weight_amax: torch.Tensor, input_amax: torch.Tensor,
                 pre_quant_scale: torch.Tensor | None):
        super().__init__()
        weight = linear.weight.detach()
        device = weight.device
        self.out_features, self.in_features = weight.shape
        weight_scale, weight_divisor = (t.to(device) for t in int8_scales(weight_amax.reshape(-1, 1)))
        input_scale, input_divisor = (t.to(device) for t in int8_scales(input_amax.reshape(())))
        self.register_buffer("weight_int8", to_int8(weight, weight_scale))
        self.register_buffer("input_scale", input_scale)
        # Per output channel: what one unit of the int32 sum is worth.
        self.register_buffer("output_scale", (1 / (input_divisor * weight_divisor)).reshape(-1))
        # Cast with the model, as ModelOpt's own buffer is, so that the multiply rounds as its does.
        self.register_buffer("pre_quant_scale", None if pre_quant_scale is None else pre_quant_scale.detach().clone())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale
        rows = to_int8(x.reshape(-1, self.in_features), self.input_scale)
        pad = max(0, MIN_GEMM_ROWS - rows.shape[0])
        if pad:
            rows = F.pad(rows, (0, 0, 0, pad))
        # The transposed contiguous weight is column-major, the layout cuBLAS's INT8 GEMM takes.
        sums = torch._int_mm(rows, self.weight_int8.t())
        if pad:
            sums = sums[:-pad]
        out = sums.float() * self.output_scale
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class Int8RoundedConv2d(KeepsExactTensors, torch.nn.Conv2d):
    """A calibrated convolution in the model's own precision on INT8-rounded weights and inputs."""

    exact = ("input_scale", "input_divisor")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(fake_int8(x, self.input_scale, self.input_divisor))
