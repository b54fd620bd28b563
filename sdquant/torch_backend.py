"""The torch backend at speed: the diffusers modules compiled with torch.compile, replayed as one
CUDA graph per input shape, and a quantize.py checkpoint's FP8 Linear layers run as FP8
tensor-core GEMMs.

FP8 here follows ModelOpt's fake quantization number for number: a tensor is multiplied by
448 / amax in fp32, clamped to E4M3's range and rounded to float8_e4m3fn, and the scale amax / 448
goes into the GEMM (``torch._scaled_mm``) instead of a dequantize. Activation scales are the
checkpoint's calibrated ranges (static), so quantizing an activation is one pointwise op that the
compiler fuses into the kernel producing it where that is a pointwise or norm kernel (not after
attention, whose kernel is an external one). Convolutions have no FP8 kernel in torch: they run
in fp16 on FP8-rounded weights and inputs, which is what ModelOpt's fake quantization computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .cuda_graphs import CapturedGraph, signature
from .errors import UserError
from .kernels.fp8 import fake_fp8, fp8_scales, to_fp8
from .quantizers import quantized_attention, quantized_inputs, unsupported_quantizers

# torch._scaled_mm wants every matrix dimension divisible by 16.
GEMM_ALIGNMENT = 16


class KeepsExactTensors:
    """Moving the module to another device moves these buffers too, but casting the module to
    another dtype leaves them as they are: float8 weights and fp32 scales are the checkpoint's
    numbers, which a `.half()` would round."""

    exact: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        kept = {name: getattr(self, name) for name in self.exact}
        super()._apply(fn, recurse)
        for name, tensor in kept.items():
            setattr(self, name, tensor.to(getattr(self, name).device))
        return self


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
        scales, as quantize.py ties them (sdquant.shared_ranges)."""
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
        pad = -rows.shape[0] % GEMM_ALIGNMENT
        if pad:
            # Padded through its bytes, which every device can pad: zero bytes are FP8 zeros.
            rows = F.pad(rows.view(torch.uint8), (0, 0, 0, pad)).view(torch.float8_e4m3fn)
        # Fast accumulation on GPUs, as FP8 inference kernels (torchao's, TensorRT's) run: Hopper's
        # FP8 tensor cores then skip the periodic promotion to full fp32 along K. The CPU kernel's
        # fast path rounds more (0.8 dB on the tiny UNet) and gains nothing there.
        out = torch._scaled_mm(rows, self.weight_fp8.t(), scale_a=self.input_scale, scale_b=self.weight_scale,
                               bias=self.bias, out_dtype=self.out_dtype, use_fast_accum=rows.is_cuda)
        if pad:
            out = out[:-pad]
        return out.reshape(*x.shape[:-1], self.out_features)


class Fp8RoundedConv2d(KeepsExactTensors, torch.nn.Conv2d):
    """A calibrated convolution in the model's own precision on FP8-rounded weights and inputs."""

    exact = ("input_scale", "input_inverse_scale")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(fake_fp8(x, self.input_inverse_scale, self.input_scale))


def _plain(layer: torch.nn.Module, kind: type = None) -> torch.nn.Module:
    """A plain torch Linear or Conv2d (or `kind`, a subclass) sharing `layer`'s weights, in place
    of ModelOpt's quantized class, which torch.compile cannot trace through."""
    if isinstance(layer, torch.nn.Linear):
        plain = (kind or torch.nn.Linear)(layer.in_features, layer.out_features, layer.bias is not None, device="meta")
    else:
        plain = (kind or torch.nn.Conv2d)(layer.in_channels, layer.out_channels, layer.kernel_size, layer.stride,
                                          layer.padding, layer.dilation, layer.groups, layer.bias is not None,
                                          layer.padding_mode, device="meta")
    plain.weight, plain.bias = layer.weight, layer.bias
    return plain


def _fp8_layer(layer: torch.nn.Module, amax: dict[str, torch.Tensor]) -> torch.nn.Module:
    if isinstance(layer, torch.nn.Linear):
        return Fp8Linear.from_linear(layer, amax["weight"], amax["input"])
    conv = _plain(layer, Fp8RoundedConv2d)
    device = layer.weight.device
    weight_inverse, weight_scale = (scale.to(device) for scale in fp8_scales(amax["weight"]))
    conv.weight = torch.nn.Parameter(fake_fp8(layer.weight.detach(), weight_inverse, weight_scale),
                                     requires_grad=False)
    input_inverse, input_scale = fp8_scales(amax["input"])
    conv.register_buffer("input_inverse_scale", input_inverse.to(device))
    conv.register_buffer("input_scale", input_scale.to(device))
    return conv


def runs_as_fp8(backbone: torch.nn.Module) -> list[str]:
    """Why the checkpoint in `backbone` cannot run with FP8 kernels: one reason per kind of quantizer
    this path has no kernel for; empty when it can."""
    reasons = []
    sites = quantized_inputs(backbone)
    if any(not site.fp8 for site in sites):
        reasons.append("INT8 layers (format=int8)")
    if unsupported_quantizers(backbone):
        reasons.append(f"quantizers on {', '.join(unsupported_quantizers(backbone)[:3])}")
    if not sites:
        reasons.append("no calibrated layer")
    return reasons


def fp8_attention_ranges(backbone: torch.nn.Module, checkpoint: str, attention: str,
                         quant_level: float | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """{attention layer: its q, k and v ranges} for the layers to run FP8 attention, as
    torch_backend.attention asks: auto, every layer the checkpoint calibrated it for; fp16, none;
    fp8, the same as auto, refused for a checkpoint without any (made at `quant_level`)."""
    from .kernels.fp8_attention import cuda_kernel_missing

    ranges = {site.layer: site.amax for site in quantized_attention(backbone)}
    if attention == "fp8" and not ranges:
        made_at = "below quant_level=4" if quant_level is None else f"at quant_level={quant_level:g}"
        raise UserError(f"torch_backend.attention=fp8: quantized_unet={checkpoint} was made {made_at}, which calibrates "
                        "no attention ranges: quantize with quantize.format=fp8 quantize.quant_level=4, or set "
                        "torch_backend.attention=auto")
    if attention == "fp16" or not ranges:
        return {}
    device = next(backbone.parameters()).device
    missing = cuda_kernel_missing(device) if device.type == "cuda" else None
    if missing:
        raise UserError(f"quantized_unet={checkpoint} holds FP8 attention (quant_level=4), but {missing}: set "
                        "torch_backend.attention=fp16 to run its attention in 16 bits")
    return ranges


@dataclass
class Fp8Conversion:
    layers: int      # calibrated Linear and Conv2d layers running on FP8 values
    attention: int   # attention layers running FP8 attention


def convert_to_fp8(backbone: torch.nn.Module, checkpoint: str, attention: str = "auto",
                   quant_level: float | None = None) -> Fp8Conversion:
    """Replaces every calibrated Linear with an Fp8Linear and every calibrated Conv2d with an
    Fp8RoundedConv2d, scales taken from the checkpoint's quantizers, and every other quantized
    module class with its plain torch layer; then gives the attention layers their fused FP8
    projections and, as torch_backend.attention asks, FP8 attention (sdquant.attention)."""
    from modelopt.torch.quantization.nn import QuantModule

    from .attention import convert_attention

    reasons = runs_as_fp8(backbone)
    if reasons:
        raise UserError(f"quantized_unet={checkpoint} holds {'; '.join(reasons)}, which torch_backend.quantized=fp8 "
                        "cannot run: it would run them in fake quantization; set torch_backend.quantized=fake for "
                        "that, or quantize with format=fp8")
    attention_ranges = fp8_attention_ranges(backbone, checkpoint, attention, quant_level)
    amax: dict[str, dict[str, torch.Tensor]] = {}
    for site in quantized_inputs(backbone):
        amax.setdefault(site.layer, {})[site.role] = site.amax
    for name, layer in list(backbone.named_modules()):
        if not isinstance(layer, QuantModule):
            continue
        if isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)):
            parent_name, _, child = name.rpartition(".")
            setattr(backbone.get_submodule(parent_name), child,
                    _fp8_layer(layer, amax[name]) if name in amax else _plain(layer))
        else:
            # Norms and attention blocks, back to diffusers' class: attention's ranges are read above.
            layer.export()
    return Fp8Conversion(len(amax), convert_attention(backbone, attention_ranges))


class GraphReplayStage:
    """A stage replayed as one CUDA graph per input signature, so the host launches one graph
    instead of every kernel of the backbone."""

    def __init__(self, stage):
        self.stage = stage
        self.graphs: dict = {}

    def __call__(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        key = signature(inputs)
        if key not in self.graphs:
            self.graphs[key] = self._capture(inputs)
        return self.graphs[key].replay(inputs)

    def _capture(self, inputs: dict[str, torch.Tensor]) -> CapturedGraph:
        static_inputs = {name: tensor.clone() for name, tensor in inputs.items()}
        # Warm up on a side stream with the very tensors the graph will read (same strides, so
        # no recompile): compiling, autotuning and library set-up must all happen before capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.stage(**static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_outputs = self.stage(**static_inputs)
        return CapturedGraph(graph, static_inputs, static_outputs)


def speed_up(pipe, family, stages: dict, block, cuda_graph: bool, quantized: bool) -> dict:
    """Applies the torch backend's settings to the stages of `pipe`, in place; returns them."""
    from .deep_cache import FULL, SHALLOW

    backbone = getattr(pipe, family.backbone)
    # The backbone (or, with a step cache, each of its passes: one compiled graph and one CUDA
    # graph per branch) and the VAE.
    graph = family.backbone_graph
    replayed = [name for name in (graph, FULL.format(graph), SHALLOW.format(graph), "vae") if name in stages]
    if block.compile:
        # diffusers' own speed recipe: channels-last convolutions, one GEMM for q, k and v.
        backbone.to(memory_format=torch.channels_last)
        pipe.vae.to(memory_format=torch.channels_last)
        if not quantized:
            backbone.fuse_qkv_projections()
        for name in replayed:
            stages[name].graph = torch.compile(stages[name].graph, mode=block.compile_mode, dynamic=block.dynamic)
            if hasattr(stages[name], "allow_recompiles"):
                stages[name].allow_recompiles()
    if cuda_graph and pipe.device.type == "cuda":
        # The text encoders stay as they are: they build masks from host tensors, which a
        # capture cannot take.
        for name in replayed:
            stages[name] = GraphReplayStage(stages[name])
    return stages
