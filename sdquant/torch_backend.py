"""The torch backend at speed: the diffusers modules compiled with torch.compile, replayed as one
CUDA graph per input shape, and a quantize.py checkpoint's Linear layers run as 8-bit GEMMs in its
own format: FP8 tensor-core GEMMs here, INT8 integer GEMMs in sdquant.kernels.int8.

FP8 here follows ModelOpt's fake quantization number for number: a tensor is multiplied by
448 / amax in fp32, clamped to E4M3's range and rounded to float8_e4m3fn, and the scale amax / 448
goes into the GEMM (``torch._scaled_mm``) instead of a dequantize. Activation scales are the
checkpoint's calibrated ranges (static), so quantizing an activation is one pointwise op that the
compiler fuses into the kernel producing it where that is a pointwise or norm kernel (not after
attention, whose kernel is an external one). Convolutions have no FP8 kernel in torch: they run
in fp16 on FP8-rounded weights and inputs, which is what ModelOpt's fake quantization computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cuda_graphs import CapturedGraph, signature
from .errors import UserError
from .kernels.exact import KeepsExactTensors
from .kernels.int8 import Int8Linear, Int8RoundedConv2d, fake_int8, int8_scales
from .quantizers import quantized_attention, quantized_inputs, unsupported_quantizers

FP8_MAX = 448.0
# torch._scaled_mm wants every matrix dimension divisible by 16.
GEMM_ALIGNMENT = 16


def fp8_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(448 / amax, its reciprocal) in fp32, computed as ModelOpt's FP8 quantizer does, so the
    rounded values are bit for bit its own (a zero range counts as 1)."""
    amax = amax.detach().float().reshape(())
    inverse = FP8_MAX / torch.where(amax <= 1.0 / (1 << 24), torch.ones_like(amax), amax)
    return inverse, 1 / inverse


def to_fp8(x: torch.Tensor, inverse_scale: torch.Tensor) -> torch.Tensor:
    return (x.float() * inverse_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fake_fp8(x: torch.Tensor, inverse_scale: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize, as ModelOpt's FP8 fake quantization does."""
    return (to_fp8(x, inverse_scale).float() * scale).to(x.dtype)


class Fp8Linear(KeepsExactTensors, torch.nn.Module):
    """A calibrated Linear layer as one FP8 GEMM with the bias and both scales in its epilogue."""

    exact = ("weight_fp8", "weight_scale", "input_scale", "input_inverse_scale")

    def __init__(self, linear: torch.nn.Linear, weight_amax: torch.Tensor, input_amax: torch.Tensor):
        super().__init__()
        weight = linear.weight.detach()
        self.out_features, self.in_features = weight.shape
        weight_inverse, weight_scale = fp8_scales(weight_amax)
        input_inverse, input_scale = fp8_scales(input_amax)
        self.register_buffer("weight_scale", weight_scale.to(weight.device))
        self.register_buffer("input_scale", input_scale.to(weight.device))
        self.register_buffer("input_inverse_scale", input_inverse.to(weight.device))
        self.register_buffer("weight_fp8", to_fp8(weight, weight_inverse.to(weight.device)))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.out_dtype = weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        pad = -rows.shape[0] % GEMM_ALIGNMENT
        if pad:
            rows = F.pad(rows, (0, 0, 0, pad))
        # Fast accumulation on GPUs, as FP8 inference kernels (torchao's, TensorRT's) run: Hopper's
        # FP8 tensor cores then skip the periodic promotion to full fp32 along K. The CPU kernel's
        # fast path rounds more (0.8 dB on the tiny UNet) and gains nothing there.
        out = torch._scaled_mm(to_fp8(rows, self.input_inverse_scale), self.weight_fp8.t(), scale_a=self.input_scale,
                               scale_b=self.weight_scale, bias=self.bias, out_dtype=self.out_dtype,
                               use_fast_accum=rows.is_cuda)
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


def _rounded_conv(layer: torch.nn.Module, kind: type, weight: torch.Tensor,
                  input_scales: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A `kind` convolution in place of `layer`, on its rounded `weight`, with the scales that
    round its input as buffers."""
    conv = _plain(layer, kind)
    conv.weight = torch.nn.Parameter(weight, requires_grad=False)
    for name, scale in input_scales.items():
        conv.register_buffer(name, scale.to(layer.weight.device))
    return conv


def _fp8_layer(layer: torch.nn.Module, amax: dict[str, torch.Tensor]) -> torch.nn.Module:
    if isinstance(layer, torch.nn.Linear):
        return Fp8Linear(layer, amax["weight"], amax["input"])
    weight_inverse, weight_scale = (scale.to(layer.weight.device) for scale in fp8_scales(amax["weight"]))
    return _rounded_conv(layer, Fp8RoundedConv2d, fake_fp8(layer.weight.detach(), weight_inverse, weight_scale),
                         dict(zip(("input_inverse_scale", "input_scale"), fp8_scales(amax["input"]))))


def _int8_layer(layer: torch.nn.Module, amax: dict[str, torch.Tensor]) -> torch.nn.Module:
    if isinstance(layer, torch.nn.Linear):
        return Int8Linear(layer, amax["weight"], amax["input"], layer.input_quantizer.pre_quant_scale)
    weight_scale, weight_divisor = (scale.to(layer.weight.device) for scale in int8_scales(amax["weight"]))
    return _rounded_conv(layer, Int8RoundedConv2d, fake_int8(layer.weight.detach(), weight_scale, weight_divisor),
                         dict(zip(("input_scale", "input_divisor"), int8_scales(amax["input"]))))


# torch_backend.quantized -> the layers its kernels replace a calibrated Linear or Conv2d with.
KERNEL_LAYERS = {"fp8": _fp8_layer, "int8": _int8_layer}


def check_format(checkpoint: str, checkpoint_format: str, quantized: str) -> None:
    """Refuses to run a checkpoint (its quantize.format) on another format's kernels."""
    if checkpoint_format != quantized:
        raise UserError(f"quantized_unet={checkpoint} is a format={checkpoint_format} checkpoint, which "
                        f"torch_backend.quantized={quantized} cannot run: set torch_backend.quantized="
                        f"{checkpoint_format} for its own {checkpoint_format.upper()} GEMMs, or "
                        "torch_backend.quantized=fake")


def cannot_run(backbone: torch.nn.Module, sites: list) -> list[str]:
    """Why the checkpoint in `backbone` (its calibrated `sites`) cannot run on its format's kernels:
    one reason per kind of quantizer they have none for; empty when it can."""
    reasons = []
    if quantized_attention(backbone):
        reasons.append("FP8 attention (quant_level=4)")
    if unsupported_quantizers(backbone):
        reasons.append(f"quantizers on {', '.join(unsupported_quantizers(backbone)[:3])}")
    if not sites:
        reasons.append("no calibrated layer")
    return reasons


def convert_quantized(backbone: torch.nn.Module, checkpoint: str, quantized: str) -> int:
    """Replaces every calibrated Linear and Conv2d with the layers of `quantized`'s kernels (fp8 or
    int8, the checkpoint's own format), scales taken from the checkpoint's quantizers, and every
    other quantized module class with its plain torch layer; returns how many layers run in 8 bits."""
    from modelopt.torch.quantization.nn import QuantModule

    sites = quantized_inputs(backbone)
    if sites:
        check_format(checkpoint, "fp8" if sites[0].fp8 else "int8", quantized)
    reasons = cannot_run(backbone, sites)
    if reasons:
        raise UserError(f"quantized_unet={checkpoint} holds {'; '.join(reasons)}, which torch_backend.quantized="
                        f"{quantized} cannot run: it would run them in fake quantization; set torch_backend."
                        f"quantized=fake for that, or quantize with format={quantized} below quant_level 4")
    amax: dict[str, dict[str, torch.Tensor]] = {}
    for site in sites:
        amax.setdefault(site.layer, {})[site.role] = site.amax
    kernel_layer = KERNEL_LAYERS[quantized]
    for name, layer in list(backbone.named_modules()):
        if not isinstance(layer, QuantModule):
            continue
        if isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)):
            parent_name, _, child = name.rpartition(".")
            setattr(backbone.get_submodule(parent_name), child,
                    kernel_layer(layer, amax[name]) if name in amax else _plain(layer))
        else:
            # Norms and attention blocks whose quantizers the recipe left off: back to diffusers' class.
            layer.export()
    return len(amax)


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
