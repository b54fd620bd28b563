"""The FP8 layers a converted checkpoint runs (torch_backend.quantized=fp8): a calibrated Linear as
one FP8 GEMM (torch._scaled_mm) and a calibrated convolution as one FP8 implicit-GEMM kernel
(torch.ops.sdquant.fp8_conv2d), with the checkpoint's scales; a convolution that kernel does not
take (grouped, dilated, unequal strides) on FP8-rounded weights and inputs. All keep their exact
FP8 weights and fp32 scales whatever dtype the model is cast to."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .exact import KeepsExactTensors
from .fp8 import fake_fp8, fp8_scales, to_fp8
from .conv8 import KernelConv2d, fp8_conv2d, triton_missing

# torch._scaled_mm wants every matrix dimension divisible by 16.
GEMM_ALIGNMENT = 16


class Fp8Linear(KeepsExactTensors, torch.nn.Module):
    """A calibrated Linear layer as one FP8 GEMM with the bias and both scales in its epilogue."""

    exact = ("weight_fp8", "weight_scale", "input_scale", "input_inverse_scale")

    def __init__(self, weight_fp8: torch.Tensor, weight_scale: torch.Tensor, input_inverse_scale: torch.Tensor,
                 input_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = weight_fp8.shape
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("input_scale", input_scale)
        self.register_buffer("input_inverse_scale", input_inverse_scale)
        self.register_buffer("weight_fp8", weight_fp8)
        self.register_buffer("bias", bias)
        self.out_dtype = out_dtype

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, weight_amax: torch.Tensor, input_amax: torch.Tensor) -> "Fp8Linear":
        weight = linear.weight.detach()
        weight_inverse, weight_scale = (s.to(weight.device) for s in fp8_scales(weight_amax))
        input_inverse, input_scale = (s.to(weight.device) for s in fp8_scales(input_amax))
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(to_fp8(weight, weight_inverse), weight_scale, input_inverse, input_scale, bias, weight.dtype)

    @classmethod
    def stacked(cls, layers: list["Fp8Linear"]) -> "Fp8Linear | None":
        """One GEMM for layers that read one input: their weights and biases stacked along the
        outputs, so its output is theirs side by side. None unless they share their weight and input
        scales, as quantize.py ties them (sdquant.quantize.shared_ranges)."""
        first = layers[0]
        if not all(torch.equal(layer.weight_scale, first.weight_scale) and torch.equal(layer.input_scale, first.input_scale)
                   and (layer.bias is None) == (first.bias is None) for layer in layers):
            return None
        bias = None if first.bias is None else torch.cat([layer.bias for layer in layers])
        return cls(torch.cat([layer.weight_fp8 for layer in layers]), first.weight_scale, first.input_inverse_scale,
                   first.input_scale, bias, first.out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        # An FP8 input was rounded with this layer's own input scale by the kernel that wrote it
        # (FP8 attention), so it goes into the GEMM as it is.
        if rows.dtype != torch.float8_e4m3fn:
            rows = to_fp8(rows, self.input_inverse_scale)
        if not rows.is_cuda:
            return self._twin(rows).reshape(*x.shape[:-1], self.out_features)
        pad = -rows.shape[0] % GEMM_ALIGNMENT
        if pad:
            # Padded through its bytes, which every device can pad: zero bytes are FP8 zeros.
            rows = F.pad(rows.view(torch.uint8), (0, 0, 0, pad)).view(torch.float8_e4m3fn)
        # Fast accumulation, as FP8 inference kernels (torchao's, TensorRT's) run: Hopper's FP8 tensor
        # cores then skip the periodic promotion to full fp32 along K.
        out = torch._scaled_mm(rows, self.weight_fp8.t(), scale_a=self.input_scale, scale_b=self.weight_scale,
                               bias=self.bias, out_dtype=self.out_dtype, use_fast_accum=True)
        if pad:
            out = out[:-pad]
        return out.reshape(*x.shape[:-1], self.out_features)

    def _twin(self, rows: torch.Tensor) -> torch.Tensor:
        """The GEMM's products of FP8 values summed in the model's precision: what ModelOpt's fake
        quantization computes. CPUs have no fast FP8 GEMM (oneDNN's reference one takes seconds for
        one), so a CPU runs this twin, which the GPU tests hold the tensor-core GEMM against."""
        return F.linear((rows.float() * self.input_scale).to(self.out_dtype),
                        (self.weight_fp8.float() * self.weight_scale).to(self.out_dtype), self.bias)


def fp8_kernels_missing(device: torch.device) -> str | None:
    """Why the FP8 GEMM and convolution kernels cannot run on CUDA `device`, in words; None when
    they can."""
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"FP8 tensor cores need an Ada or Hopper GPU (sm89+), and {torch.cuda.get_device_name(device)} "
                f"is sm{major}{minor}")
    return triton_missing()


class Fp8Conv2d(KernelConv2d):
    """A calibrated convolution as one FP8 kernel, the bias and both scales in its epilogue."""

    exact = ("weight_fp8", "weight_scale", "input_scale", "input_inverse_scale")
    kernel = fp8_conv2d

    def __init__(self, conv: torch.nn.Conv2d, weight_amax: torch.Tensor, input_amax: torch.Tensor):
        super().__init__(conv)
        weight = conv.weight.detach()
        weight_inverse, weight_scale = (s.to(weight.device) for s in fp8_scales(weight_amax))
        input_inverse, input_scale = (s.to(weight.device) for s in fp8_scales(input_amax))
        self.register_buffer("weight_fp8", to_fp8(weight.permute(0, 2, 3, 1).contiguous(), weight_inverse))
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("input_scale", input_scale)
        self.register_buffer("input_inverse_scale", input_inverse)

    def operands(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Channels-last FP8, as the kernel reads its input fastest: eager GroupNorm hands over NCHW
        # memory on CUDA. Under torch.compile the custom op takes its input in the strides it was
        # traced with, so the compiler writes this layout in the norm's kernel (its own clone
        # ignores memory formats).
        x = to_fp8(x, self.input_inverse_scale).contiguous(memory_format=torch.channels_last)
        return x, self.weight_fp8, self.input_scale, self.weight_scale


class Fp8RoundedConv2d(KeepsExactTensors, torch.nn.Conv2d):
    """A calibrated convolution in the model's own precision on FP8-rounded weights and inputs."""

    exact = ("input_scale", "input_inverse_scale")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(fake_fp8(x, self.input_inverse_scale, self.input_scale))
