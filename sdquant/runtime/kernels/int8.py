"""A format=int8 checkpoint's calibrated layers for the torch backend: Linear layers as integer
GEMMs (int8 x int8 -> int32, ``torch._int_mm``), convolutions as integer implicit-GEMM kernels
(``torch.ops.sdquant.int8_conv2d``, sdquant.runtime.kernels.conv8) where a layer and the GPU suit
them, else in the model's precision on INT8-rounded weights and inputs.

Every rounding is ModelOpt's INT8 fake quantization, number for number: in fp32, a tensor times
127 / amax (weights one amax per output channel, activations one per tensor), rounded half to even
and clamped to [-128, 127]; a range under 2**-24 rounds everything to 0. SmoothQuant's per-channel
scale (ModelOpt's pre_quant_scale on the input quantizer) multiplies the input first, in the input's
precision as ModelOpt does; its inverse is already folded into the checkpoint's weights. The GEMM
sums exactly in int32, and one pointwise epilogue applies both scales and the bias, which
torch.compile fuses with the GEMM's output as it fuses the input's rounding into its producer; the
convolution kernel applies them in its own epilogue.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .conv8 import KernelConv2d, int8_conv2d, takes, triton_missing
from .exact import KeepsExactTensors

INT8_MAX = 127.0
INT8_MIN = -128.0
# ModelOpt treats a smaller range as zero: fp16's smallest subnormal.
ZERO_RANGE = 1.0 / (1 << 24)
# torch._int_mm on CUDA takes only more than 16 rows (and widths that are multiples of 8, as every
# SDXL and Flux layer's are).
MIN_GEMM_ROWS = 17
# The first GPUs whose integer tensor cores Triton's dot runs on: Ampere.
MIN_CONV_CAPABILITY = (8, 0)


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


def int8_conv_runs(conv: torch.nn.Conv2d) -> bool:
    """Whether `conv` runs as one integer kernel where its weights lie: a shape the kernel takes
    (sdquant.runtime.kernels.conv8.takes), on the CPU (its twin) or on an Ampere or newer GPU with
    Triton. Otherwise (grouped or dilated; Turing; no Triton) it stays a 16-bit convolution on the
    same INT8-rounded values, whose sums differ from the kernel's exact ones only by fp16 rounding."""
    device = conv.weight.device
    if not takes(conv):
        return False
    if device.type == "cpu":
        return True
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_CONV_CAPABILITY
            and triton_missing() is None)


class Int8Conv2d(KernelConv2d):
    """A calibrated convolution as one integer implicit-GEMM kernel: exact int32 sums, the input's and
    each output channel's divisor and the bias in its epilogue."""

    exact = ("weight_divisor", "input_scale", "input_divisor")
    kernel = int8_conv2d

    def __init__(self, conv: torch.nn.Conv2d, weight_amax: torch.Tensor, input_amax: torch.Tensor):
        super().__init__(conv)
        weight = conv.weight.detach()
        device = weight.device
        # One range per output channel (ModelOpt's axis 0 keeps them as (out, 1, 1, 1)).
        weight_scale, weight_divisor = (t.to(device) for t in int8_scales(weight_amax.reshape(-1, 1, 1, 1)))
        input_scale, input_divisor = (t.to(device) for t in int8_scales(input_amax.reshape(())))
        # (out channels, kernel rows, kernel columns, in channels), as the kernel reads filters.
        self.register_buffer("weight_int8", to_int8(weight, weight_scale).permute(0, 2, 3, 1).contiguous())
        # One divisor per output channel for the kernel's epilogue, a per-tensor range repeated.
        self.register_buffer("weight_divisor", weight_divisor.reshape(-1).expand(weight.shape[0]).contiguous())
        self.register_buffer("input_scale", input_scale)
        self.register_buffer("input_divisor", input_divisor)

    def operands(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Channels-last, as the kernel reads its input fastest; under torch.compile the custom op takes
        # its input in the strides it was traced with, written by the input's producer, rounding fused.
        x = to_int8(x, self.input_scale).contiguous(memory_format=torch.channels_last)
        return x, self.weight_int8, self.input_divisor, self.weight_divisor
