"""The torch backend at speed: the diffusers modules compiled with torch.compile, replayed as one
CUDA graph per input shape, and a quantize.py checkpoint converted to 8-bit kernels in its own
format: its Linear layers and convolutions as FP8 tensor-core GEMMs and implicit-GEMM convolutions
(sdquant.runtime.kernels.fp8_layers) or as INT8 integer GEMMs and implicit-GEMM convolutions
(sdquant.runtime.kernels.int8), its FP8 q/k/v projections that read one input as one GEMM and, at
quant_level=4, its attention as FP8 attention (sdquant.runtime.attention).

FP8 here follows ModelOpt's fake quantization number for number: a tensor is multiplied by
448 / amax in fp32, clamped to E4M3's range and rounded to float8_e4m3fn, and the scale amax / 448
goes into the GEMM (``torch._scaled_mm``) instead of a dequantize. Activation scales are the
checkpoint's calibrated ranges (static), so quantizing an activation is one pointwise op that the
compiler fuses into the kernel producing it where that is a pointwise or norm kernel; after FP8
attention there is none, its kernel writing the FP8 output itself. A convolution the 8-bit
kernels do not take (grouped, dilated; INT8 on a GPU older than Ampere) runs in 16 bits on
8-bit-rounded weights and inputs, which is what ModelOpt's fake quantization computes.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import torch

from .attention import chosen_kernel, use_attention_kernel
from .attention_window import use_attention_window
from .compiled_forms import pin_channels_last_outputs, use_compiled_forms, use_persistent_rows, use_sigmoid_gelu
from ..cuda_graphs import CapturedGraph, signature
from .stages import InTurn
from ..errors import UserError
from .kernels.conv8 import takes
from .kernels.fp8_geglu import fuse_geglus
from .kernels.fp8_layers import Fp8Conv2d, Fp8Linear, Fp8RoundedConv2d, fp8_kernels_missing
from .kernels.fp8 import fake_fp8, fp8_scales
from .kernels.int8 import Int8Conv2d, Int8Linear, Int8RoundedConv2d, fake_int8, int8_conv_runs, int8_scales
from ..quantize.quantizers import quantized_attention, quantized_inputs, unsupported_quantizers

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
        return Fp8Linear.from_linear(layer, amax["weight"], amax["input"])
    if takes(layer):
        return Fp8Conv2d(layer, amax["weight"], amax["input"])
    weight_inverse, weight_scale = (scale.to(layer.weight.device) for scale in fp8_scales(amax["weight"]))
    return _rounded_conv(layer, Fp8RoundedConv2d, fake_fp8(layer.weight.detach(), weight_inverse, weight_scale),
                         dict(zip(("input_inverse_scale", "input_scale"), fp8_scales(amax["input"]))))


def _int8_layer(layer: torch.nn.Module, amax: dict[str, torch.Tensor]) -> torch.nn.Module:
    if isinstance(layer, torch.nn.Linear):
        return Int8Linear(layer, amax["weight"], amax["input"], layer.input_quantizer.pre_quant_scale)
    if int8_conv_runs(layer):
        return Int8Conv2d(layer, amax["weight"], amax["input"])
    weight_scale, weight_divisor = (scale.to(layer.weight.device) for scale in int8_scales(amax["weight"]))
    return _rounded_conv(layer, Int8RoundedConv2d, fake_int8(layer.weight.detach(), weight_scale, weight_divisor),
                         dict(zip(("input_scale", "input_divisor"), int8_scales(amax["input"]))))


# torch_backend.quantized -> the layers its kernels replace a calibrated Linear or Conv2d with.
KERNEL_LAYERS = {"fp8": _fp8_layer, "int8": _int8_layer}


def check_format(named: str, checkpoint_format: str, quantized: str) -> None:
    """Refuses to run a checkpoint (its quantize.format) on another format's kernels; `named`
    is the config key and value that name it."""
    if checkpoint_format != quantized:
        raise UserError(f"{named} is a format={checkpoint_format} checkpoint, which torch_backend.quantized="
                        f"{quantized} cannot run: set torch_backend.quantized={checkpoint_format} for its own "
                        f"{checkpoint_format.upper()} GEMMs, or torch_backend.quantized=fake")


def cannot_run(backbone: torch.nn.Module, sites: list) -> list[str]:
    """Why the checkpoint in `backbone` (its calibrated `sites`) cannot run on its format's kernels:
    one reason per kind of quantizer they have none for; empty when it can."""
    reasons = []
    unsupported = unsupported_quantizers(backbone)
    if unsupported:
        reasons.append(f"quantizers on {', '.join(unsupported[:3])}")
    if not sites:
        reasons.append("no calibrated layer")
    return reasons


def fp8_attention_ranges(backbone: torch.nn.Module, named: str, attention: str,
                         quant_level: float | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """{attention layer: its q, k and v ranges} for the layers to run FP8 attention, as
    torch_backend.attention asks: auto, every layer the checkpoint calibrated it for; fp16, none;
    fp8, the same as auto, refused for a checkpoint without any (made at `quant_level`)."""
    from .kernels.fp8_attention import cuda_kernel_missing

    ranges = {site.layer: site.amax for site in quantized_attention(backbone)}
    if attention == "fp8" and not ranges:
        raise no_attention_ranges(named, quant_level)
    if attention == "fp16" or not ranges:
        return {}
    device = next(backbone.parameters()).device
    missing = cuda_kernel_missing(device) if device.type == "cuda" else None
    if missing:
        raise UserError(f"{named} holds FP8 attention (quant_level=4), but {missing}: set "
                        "torch_backend.attention=fp16 to run its attention in 16 bits")
    return ranges


def no_attention_ranges(named: str, quant_level: float | None) -> UserError:
    """The refusal of torch_backend.attention=fp8 for a checkpoint made without attention ranges."""
    made_at = "below quant_level=4" if quant_level is None else f"at quant_level={quant_level:g}"
    return UserError(f"torch_backend.attention=fp8: {named} was made {made_at}, which calibrates no attention "
                     "ranges: quantize with quantize.format=fp8 quantize.quant_level=4, or set "
                     "torch_backend.attention=auto")


def _check_fp8_kernels(backbone: torch.nn.Module, named: str) -> None:
    device = next(backbone.parameters()).device
    missing = fp8_kernels_missing(device) if device.type == "cuda" else None
    if missing:
        raise UserError(f"torch_backend.quantized=fp8 runs {named} on FP8 kernels, but {missing}: set "
                        "torch_backend.quantized=fake to run it in fake quantization")


# Hopper: where torch._int_mm runs CUTLASS's Ampere kernels (mma.sync, not Hopper's wgmma).
HOPPER = (9, 0)


def _note_int8_on_hopper(backbone: torch.nn.Module, named: str) -> None:
    # The INT8 SDXL UNet measured slower than fp16 on an H100 (benchmarks/results/sdxl_pinned_h100_b8.json);
    # Ada, the other GPU with FP8, was not measured.
    device = next(backbone.parameters()).device
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= HOPPER:
        print(f"note: {named} runs on INT8 kernels, made for GPUs without FP8; on "
              f"{torch.cuda.get_device_name(device)} they run slower than fp16, and an FP8 checkpoint "
              "(quantize.format=fp8) runs faster (docs/speed.md)")


@dataclass
class Conversion:
    layers: int      # calibrated Linear and Conv2d layers running on 8-bit values
    attention: int   # attention layers running FP8 attention


def convert_quantized(backbone: torch.nn.Module, family, named: str, quantized: str, attention: str = "auto",
                      quant_level: float | None = None) -> Conversion:
    """Replaces every calibrated Linear and Conv2d with the layers of `quantized`'s kernels (fp8 or
    int8, the checkpoint's own format), scales taken from the checkpoint's quantizers, and every
    other quantized module class with its plain torch layer; for FP8, then gives the attention layers
    their fused projections and, as torch_backend.attention asks, FP8 attention (sdquant.runtime.attention)
    by `family`'s processors. `named`: the config key and value that name the checkpoint, for messages."""
    from modelopt.torch.quantization.nn import QuantModule

    from .attention import convert_attention

    sites = quantized_inputs(backbone)
    if sites:
        check_format(named, "fp8" if sites[0].fp8 else "int8", quantized)
    reasons = cannot_run(backbone, sites)
    if reasons:
        raise UserError(f"{named} holds {'; '.join(reasons)}, which torch_backend.quantized={quantized} cannot run: "
                        "it would run them in fake quantization; set torch_backend.quantized=fake for that")
    if quantized == "fp8":
        _check_fp8_kernels(backbone, named)
    else:
        _note_int8_on_hopper(backbone, named)
    attention_ranges = fp8_attention_ranges(backbone, named, attention, quant_level) if quantized == "fp8" else {}
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
            # Norms and attention blocks, back to diffusers' class: attention's ranges are read above.
            layer.export()
    fp8_attention = (convert_attention(backbone, attention_ranges, family.fp8_attention_processor,
                                       family.attention_projections) if quantized == "fp8" else 0)
    return Conversion(len(amax), fp8_attention)


class InSlices(torch.nn.Module):
    """A graph of one batched input run on `size` samples at a time. Each slice's output is copied
    into the batch's before the next call: the compiler's own CUDA graphs (compile_mode
    reduce-overhead or max-autotune) overwrite a call's outputs on the next."""

    def __init__(self, graph, size: int):
        super().__init__()
        self.graph, self.size = graph, size

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        if len(batch) <= self.size:
            return self.graph(batch)
        outputs = None
        for start in range(0, len(batch), self.size):
            output = self.graph(batch[start:start + self.size])
            if outputs is None:
                outputs = output.new_empty((len(batch), *output.shape[1:]))
            outputs[start:start + len(output)].copy_(output)
        return outputs


def decode_in_slices(family, stages: dict, images: int) -> dict:
    """`stages` with the decoder's run on `images` images at a time (0: the whole batch), in place;
    returns them. At 1024x1024 the decoder's activations of a batch dwarf the backbone's."""
    from ..graphs.networks import Role

    if images:
        for name in stages:
            if family.network(name).role is Role.decoder:
                stages[name].graph = InSlices(stages[name].graph, images)
    return stages


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


def compile_settings(block) -> dict:
    """torch.compile's keywords for `block`: its mode, or with tune_kernels the mode's own inductor
    options plus coordinate descent tuning (torch.compile takes a mode or options, not both)."""
    if not block.tune_kernels:
        return {"mode": block.compile_mode}
    from torch._inductor import list_mode_options

    return {"options": {**list_mode_options(block.compile_mode), "coordinate_descent_tuning": True}}


def tag_compile_cache() -> None:
    """Puts the schemas of sdquant's torch ops in torch.compile's cache key. Inductor's own key leaves
    out a call's arguments that equal their defaults, so code compiled against an op's older schema
    (one argument more, passed at its default) is reused after the op loses that argument, and fails
    calling it: a compiled run did so after sdquant::fp8_attention lost its flash3 flag
    (tests/test_torch_backend.py reproduces it). A tag the user set stays in front."""
    schemas = sorted(str(schema) for schema in torch._C._jit_get_all_schemas() if schema.name.startswith("sdquant::"))
    tag = "sdquant-ops-" + hashlib.sha256("\n".join(schemas).encode()).hexdigest()[:16]
    own = re.sub(r"\s*sdquant-ops-[0-9a-f]+", "", torch.compiler.config.cache_key_tag)
    torch.compiler.config.cache_key_tag = f"{own} {tag}".strip()


def compiled_backbone_forms(module: torch.nn.Module, family, quantized: bool) -> None:
    """Puts one backbone module of `family` in the forms speed_up compiles it in (the reasons are
    there), in place; `quantized`: its layers are the 8-bit kernels' already."""
    if family.channels_last:
        module.to(memory_format=torch.channels_last)
    use_sigmoid_gelu(module)
    if quantized:
        if family.channels_last:
            pin_channels_last_outputs(module)
        use_compiled_forms(module)
        fuse_geglus(module)
    else:
        family.fuse_projections(module)
    family.use_family_forms(module)


def in_turn(stage, size: int) -> InTurn:
    """`stage` run `size` samples a call (a hooked stage takes the size itself: it keeps a cache
    context for each part)."""
    if not isinstance(stage, InTurn):
        stage = InTurn(stage)
    stage.size = size
    return stage


def speed_up(pipe, family, stages: dict, block, cuda_graph: bool, quantized: bool) -> dict:
    """Applies the torch backend's settings to the stages of `pipe`, in place; returns them."""
    prepare_modules(family, family.backbone_modules(pipe), pipe.vae, block, quantized, pipe.device)
    stages = fast_stages(family, stages, block, cuda_graph, pipe.device)
    # Run once a generation, eager: a few small kernels and one GEMM per AdaLN map.
    stages.update(family.generation_stages(pipe))
    return stages


def speed_up_backbones(family, modules: dict, stages: dict, block, cuda_graph: bool, device: torch.device,
                       quantized: bool) -> dict:
    """speed_up for backbone modules and their stages alone (the others' stages already at speed)."""
    prepare_modules(family, modules, None, block, quantized, device)
    return fast_stages(family, stages, block, cuda_graph, device)


def prepare_modules(family, modules: dict, vae, block, quantized: bool, device: torch.device) -> None:
    """The backbone modules (by attribute) and the VAE (None: leave it) in the forms the torch
    backend runs them in, in place: their attention kernel and window and, where it compiles, the
    forms it compiles them in.

    diffusers' own speed recipe: channels-last convolutions, one GEMM for q, k and v; and the
    decoder's layers in forms that compile to faster kernels (sdquant.runtime.compiled_forms). An
    8-bit backbone's block outputs are pinned channels-last and its GroupNorms take the form too
    (faster only together); a 16-bit backbone keeps the compiler's layouts, which ran it faster.
    Every backbone's tanh-approximated GELUs take their sigmoid form, the same function in fewer
    instructions, and its family's own forms (Flux: q/k features in the order its rotary embedding
    compiles best in; Flux and SD3.5: their AdaLN modulations taken precomputed for every step from
    a stage of their own, from generation_stages, unless a cache hook is on). An FP8 backbone's GEGLU
    layers run as one kernel each, GEMM, gating and rounding (sdquant.runtime.kernels.fp8_geglu).
    Rows up to 2048 wide (SDXL's 1280-wide LayerNorms) are reduced in registers. A video family's
    3-D convolutions (its patch embedding, its VAE) have no channels-last form."""
    kernel = chosen_kernel(block.attention_kernel, device)
    for module in modules.values():
        use_attention_kernel(module, kernel)
    use_attention_window(family, modules, block.attention_window)
    if not block.compile:
        return
    for module in modules.values():
        compiled_backbone_forms(module, family, quantized)
    if vae is not None and family.compiles_decoder:
        if family.channels_last:
            vae.to(memory_format=torch.channels_last)
        use_compiled_forms(vae)
    use_persistent_rows()
    tag_compile_cache()


def fast_stages(family, stages: dict, block, cuda_graph: bool, device: torch.device) -> dict:
    """`stages` (any of a pipeline's, by graph name) at the torch backend's settings, in place:
    a family's backbones run a few samples a call where it says so; the backbones' stages (each
    cached pass its own) and, where the family compiles it, the decoder's compiled, the decoder run
    on vae_batch images at a time, and each compiled stage replayed as one CUDA graph per shape;
    returns them."""
    from ..graphs.networks import Role

    for backbone in family.backbones:
        if family.backbone_call_samples and backbone.graph in stages:
            stages[backbone.graph] = in_turn(stages[backbone.graph], family.backbone_call_samples)
    roles = (Role.backbone, Role.decoder) if family.compiles_decoder else (Role.backbone,)
    replayed = [name for name in stages if family.network(name).role in roles]
    if block.compile:
        for name in replayed:
            stages[name].graph = torch.compile(stages[name].graph, dynamic=block.dynamic, **compile_settings(block))
            if hasattr(stages[name], "allow_recompiles"):
                stages[name].allow_recompiles()
    # Outside the compiled graph, so that it compiles for vae_batch images, not an unrolled batch.
    decode_in_slices(family, stages, block.vae_batch)
    if cuda_graph and device.type == "cuda":
        # The text encoders stay as they are: they build masks from host tensors, which a
        # capture cannot take.
        for name in replayed:
            stages[name] = GraphReplayStage(stages[name])
    return stages
