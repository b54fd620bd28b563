"""FP8 convolution as one torch op, ``torch.ops.sdquant.fp8_conv2d``: an FP8 input and FP8 weights
with their per-tensor scales in, the convolution in the model's 16-bit precision out.

torch has no FP8 convolution, and cuDNN's runs at 0.4x of its fp16 one on Hopper
(../shared/ENVIRONMENT.md), so on a CUDA GPU the op runs implicit-GEMM Triton kernels
(sdquant.runtime.kernels.fp8_conv_triton) that read the input where it lies, without an unfolded
copy. On the CPU it runs its twin, the dequantized convolution in the output precision, which is
what ModelOpt's fake quantization computes and what the GPU tests hold the kernels against.

Weights are (out channels, kernel rows, kernel columns, in channels). A fake (meta) implementation
gives torch.compile the output's shape and channels-last strides, so a compiled model traces the
op as one node, fuses the input's FP8 rounding into the kernel that produces it, and a CUDA graph
captures the kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The smallest strip of input channels a kernel step reads (sdquant.runtime.kernels.fp8_conv_triton):
# a layer's input channels come in whole strips.
CHANNEL_STRIP = 32


def conv_output(x: torch.Tensor, weight: torch.Tensor, stride: int, padding: int, out_dtype: torch.dtype) -> torch.Tensor:
    """The op's output, empty: (batch, out channels, height, width) in channels-last memory."""
    batch, _, height, width = x.shape
    out_channels, kernel_h, kernel_w, _ = weight.shape
    out_h = (height + 2 * padding - kernel_h) // stride + 1
    out_w = (width + 2 * padding - kernel_w) // stride + 1
    return torch.empty((batch, out_channels, out_h, out_w), dtype=out_dtype, device=x.device,
                       memory_format=torch.channels_last)


def reference_conv2d(x: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None, stride: int, padding: int, out_dtype: torch.dtype) -> torch.Tensor:
    """The op's twin in plain torch, on any device: input and weights dequantized with their scales
    (amax / 448) to `out_dtype`, convolved there."""
    filters = (weight.float() * weight_scale).to(out_dtype).permute(0, 3, 1, 2).contiguous()
    out = F.conv2d((x.float() * x_scale).to(out_dtype), filters, None if bias is None else bias.to(out_dtype), stride,
                   padding)
    # Into the op's own output, whose strides the fake implementation promises even where a
    # size-1 dimension makes both layouts contiguous.
    return conv_output(x, weight, stride, padding, out_dtype).copy_(out)


@torch.library.custom_op("sdquant::fp8_conv2d", mutates_args=(), device_types="cpu")
def fp8_conv2d(x: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, stride: int, padding: int, out_dtype: torch.dtype) -> torch.Tensor:
    """The convolution of FP8 `x` (batch, channels, height, width) with FP8 `weight` (out channels,
    kernel rows, kernel columns, in channels), each with its scale (amax / 448), plus `bias`, in
    `out_dtype`, channels-last."""
    return reference_conv2d(x, weight, x_scale, weight_scale, bias, stride, padding, out_dtype)


@fp8_conv2d.register_fake
def _(x, weight, x_scale, weight_scale, bias, stride, padding, out_dtype):
    return conv_output(x, weight, stride, padding, out_dtype)


def takes(conv: torch.nn.Conv2d) -> bool:
    """Whether the kernel computes `conv`: one group, no dilation, the same stride and zero padding
    along both sides, and input channels in whole strips."""
    return (conv.groups == 1 and conv.dilation == (1, 1) and conv.stride[0] == conv.stride[1]
            and isinstance(conv.padding, tuple) and conv.padding[0] == conv.padding[1]
            and conv.padding_mode == "zeros" and conv.in_channels % CHANNEL_STRIP == 0)


@fp8_conv2d.register_kernel("cuda")
def _(x, weight, x_scale, weight_scale, bias, stride, padding, out_dtype):
    # Imported here: Triton is only needed where the op runs on a GPU.
    from .fp8_conv_triton import triton_conv2d

    return triton_conv2d(x, weight, x_scale, weight_scale, bias, stride, padding,
                         conv_output(x, weight, stride, padding, out_dtype))
