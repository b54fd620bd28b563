"""8-bit convolutions as torch ops: ``torch.ops.sdquant.fp8_conv2d`` and ``torch.ops.sdquant.int8_conv2d``
take an 8-bit input and 8-bit weights with their scales (INT8: divisors) and return the convolution
in the model's 16-bit precision; KernelConv2d is the layer that calls one.

torch's own convolutions take no 8-bit tensors on GPUs, and cuDNN's FP8 convolution runs at 0.4x of
its fp16 one on Hopper (../shared/ENVIRONMENT.md), so on a CUDA GPU both ops run implicit-GEMM
Triton kernels (sdquant.runtime.kernels.conv8_triton) that read the input where it lies, without
an unfolded copy: exact products summed in fp32 (FP8) or int32 (INT8). On the CPU each runs its twin, the dequantized
convolution in the output precision, which is what ModelOpt's fake quantization computes and what
the GPU tests hold the kernels against.

Weights are (out channels, kernel rows, kernel columns, in channels). A fake (meta) implementation
gives torch.compile the output's shape and channels-last strides, so a compiled model traces each
op as one node, fuses the input's 8-bit rounding into the kernel that produces it, and a CUDA graph
captures the kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .exact import KeepsExactTensors

# The smallest strip of input channels a kernel step reads (sdquant.runtime.kernels.conv8_triton):
# a layer's input channels come in whole strips.
CHANNEL_STRIP = 32


def conv_output(x: torch.Tensor, weight: torch.Tensor, stride: int, padding: int, out_dtype: torch.dtype) -> torch.Tensor:
    """An op's output, empty: (batch, out channels, height, width) in channels-last memory."""
    batch, _, height, width = x.shape
    out_channels, kernel_h, kernel_w, _ = weight.shape
    out_h = (height + 2 * padding - kernel_h) // stride + 1
    out_w = (width + 2 * padding - kernel_w) // stride + 1
    return torch.empty((batch, out_channels, out_h, out_w), dtype=out_dtype, device=x.device,
                       memory_format=torch.channels_last)


def _dequantized_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: int, padding: int,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """The convolution of dequantized fp32 `x` and `weight` (out channels, kernel rows, kernel
    columns, in channels), both rounded to `out_dtype` and convolved there, as fake quantization
    does, with the canonical channels-last strides the fake implementations promise (also where a
    size-1 dimension makes both layouts count as contiguous)."""
    filters = weight.to(out_dtype).permute(0, 3, 1, 2).contiguous()
    out = F.conv2d(x.to(out_dtype), filters, None if bias is None else bias.to(out_dtype), stride, padding)
    return torch.empty_like(out, memory_format=torch.channels_last).copy_(out)


def reference_fp8_conv2d(x: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None, stride: int, padding: int, out_dtype: torch.dtype) -> torch.Tensor:
    """fp8_conv2d's twin in plain torch, on any device: input and weights dequantized with their
    scales (amax / 448)."""
    return _dequantized_conv2d(x.float() * x_scale, weight.float() * weight_scale, bias, stride, padding, out_dtype)


def _check_divisors(weight: torch.Tensor, weight_divisor: torch.Tensor) -> None:
    # The kernel reads one divisor per output channel; a per-tensor one would read past its end.
    if weight_divisor.shape != weight.shape[:1]:
        raise ValueError(f"int8_conv2d takes one weight divisor per output channel ({weight.shape[0]}), "
                         f"not {tuple(weight_divisor.shape)}")


def reference_int8_conv2d(x: torch.Tensor, weight: torch.Tensor, x_divisor: torch.Tensor, weight_divisor: torch.Tensor,
                          bias: torch.Tensor | None, stride: int, padding: int, out_dtype: torch.dtype) -> torch.Tensor:
    """int8_conv2d's twin in plain torch, on any device: the input divided by its divisor and each
    output channel's filter by its own, as ModelOpt dequantizes INT8 (sdquant.runtime.kernels.int8)."""
    _check_divisors(weight, weight_divisor)
    return _dequantized_conv2d(x.float() / x_divisor, weight.float() / weight_divisor.reshape(-1, 1, 1, 1), bias,
                               stride, padding, out_dtype)


@torch.library.custom_op("sdquant::fp8_conv2d", mutates_args=(), device_types="cpu")
def fp8_conv2d(x: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, stride: int, padding: int, out_dtype: torch.dtype) -> torch.Tensor:
    """The convolution of FP8 `x` (batch, channels, height, width) with FP8 `weight` (out channels,
    kernel rows, kernel columns, in channels), each with its scale (amax / 448), plus `bias`, in
    `out_dtype`, channels-last."""
    return reference_fp8_conv2d(x, weight, x_scale, weight_scale, bias, stride, padding, out_dtype)


@torch.library.custom_op("sdquant::int8_conv2d", mutates_args=(), device_types="cpu")
def int8_conv2d(x: torch.Tensor, weight: torch.Tensor, x_divisor: torch.Tensor, weight_divisor: torch.Tensor,
                bias: torch.Tensor | None, stride: int, padding: int, out_dtype: torch.dtype) -> torch.Tensor:
    """The convolution of INT8 `x` (batch, channels, height, width) with INT8 `weight` (out channels,
    kernel rows, kernel columns, in channels), dequantized by `x_divisor` (one, 127 / amax) and
    `weight_divisor` (one per output channel), plus `bias`, in `out_dtype`, channels-last."""
    return reference_int8_conv2d(x, weight, x_divisor, weight_divisor, bias, stride, padding, out_dtype)


@fp8_conv2d.register_fake
def _(x, weight, x_scale, weight_scale, bias, stride, padding, out_dtype):
    return conv_output(x, weight, stride, padding, out_dtype)


@int8_conv2d.register_fake
def _(x, weight, x_divisor, weight_divisor, bias, stride, padding, out_dtype):
    return conv_output(x, weight, stride, padding, out_dtype)


def takes(conv: torch.nn.Conv2d) -> bool:
    """Whether the kernels compute `conv`: one group, no dilation, the same stride and zero padding
    along both sides, and input channels in whole strips."""
    return (conv.groups == 1 and conv.dilation == (1, 1) and conv.stride[0] == conv.stride[1]
            and isinstance(conv.padding, tuple) and conv.padding[0] == conv.padding[1]
            and conv.padding_mode == "zeros" and conv.in_channels % CHANNEL_STRIP == 0)


def triton_missing() -> str | None:
    """Why the kernels cannot run here, in words; None when Triton imports."""
    try:
        import triton  # noqa: F401
    except ImportError as error:
        return f"the 8-bit convolution kernels need Triton (import triton: {error})"
    return None


@fp8_conv2d.register_kernel("cuda")
def _(x, weight, x_scale, weight_scale, bias, stride, padding, out_dtype):
    # Imported here: Triton is only needed where the op runs on a GPU.
    from .conv8_triton import triton_conv2d

    return triton_conv2d(x, weight, x_scale, weight_scale, bias, stride, padding,
                         conv_output(x, weight, stride, padding, out_dtype))


@int8_conv2d.register_kernel("cuda")
def _(x, weight, x_divisor, weight_divisor, bias, stride, padding, out_dtype):
    from .conv8_triton import triton_conv2d

    _check_divisors(weight, weight_divisor)
    return triton_conv2d(x, weight, x_divisor, weight_divisor, bias, stride, padding,
                         conv_output(x, weight, stride, padding, out_dtype))


class KernelConv2d(KeepsExactTensors, torch.nn.Module):
    """A calibrated convolution as one call of an 8-bit op (`kernel`, a subclass's), the bias and the
    scales in the op's epilogue. A subclass keeps its 8-bit weights and scales and rounds the input
    (`operands`); this keeps `conv`'s geometry and bias."""

    kernel = None  # the op a subclass calls: this class is never used itself

    def __init__(self, conv: torch.nn.Conv2d):
        super().__init__()
        self.register_buffer("bias", None if conv.bias is None else conv.bias.detach().clone())
        self.stride, self.padding = conv.stride[0], conv.padding[0]
        self.out_dtype = conv.weight.dtype

    def operands(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The op's first four arguments: `x` rounded to 8 bits in channels-last memory, the 8-bit
        weights, and the scales (FP8) or divisors (INT8) of both."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(*self.operands(x), self.bias, self.stride, self.padding, self.out_dtype)
