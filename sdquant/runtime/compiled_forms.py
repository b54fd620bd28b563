"""Forms of diffusers' layers that torch.compile turns into faster GPU kernels, computing the same
numbers up to fp32 rounding. The torch backend gives the GroupNorm, attention and layout forms to
the VAE it compiles and to an 8-bit backbone (torch_backend.speed_up says why not to a 16-bit one),
and the GELU form to every backbone it compiles. docs/speed.md gives what each form takes off a
call, with its result file.

GroupNorm on channels-last activations: the compiler reduces each group over its pixels and its
channels together, and in channels-last memory a group's few channels sit between other groups'
at every pixel, so those loads gather a few bytes from each 32-byte sector. Here the mean and
variance are reduced per channel first, over pixels, which reads whole pixels side by side as
batch norm's statistics do, and the channels of a group are then combined exactly: the group's
variance is the mean of its channels' variances plus the variance of their means.

Attention with heads wider than the fused kernels take (the VAE's one head of 512): torch then
runs its memory-efficient kernel for Ampere; diffusers' sliced processor of explicit GEMMs and a
softmax compiles to tensor-core GEMMs around one fused softmax kernel instead, a sample at a time,
so that its scores (16384 x 16384 at 1024x1024) never exist for the whole batch at once.

Channels-last block outputs in a UNet: the compiler lays out a buffer it makes as the first
reader asks, and where none asks (a `torch.cat` of a skip connection, a residual sum) it picks
channels-first, whatever memory format the code asked for (its `clone` ignores it). The
convolutions after it read channels-last, so a GroupNorm+SiLU kernel would read channels-first and
write channels-last, a byte or two per 32-byte sector (benchmarks/results/group_norm_kernels_h100.json).
Pinning each block's output to channels-last, as a layout the compiler must give that buffer when
it first makes it, sets the cat's layout too.

GELU's tanh approximation (the feed-forward layers of Flux and SD3): the compiler computes tanh
with libdevice's accurate tanh, and with an FP8 input cast fused in, those kernels spend more time
computing than moving bytes. 0.5 (1 + tanh(z)) is sigmoid(2z), and the compiler's sigmoid is one
exponential and one division: the same function up to fp32 rounding (nearer the exact value for
large negative inputs, where 1 + tanh(z) cancels).

Rows up to 2048 wide reduced in registers: inductor keeps a whole row in registers (a persistent
reduction) only up to 1024 elements and reduces wider rows in a loop, which reads each row twice
(statistics, then the normalized values), as SDXL's 1280-wide LayerNorms (each fused with its
residual add and the next GEMM's FP8 cast) would be. `use_persistent_rows` gives inductor's
heuristic that wider bound, through its own hook for such choices (V.set_choices_handler, for the
compiling thread). Inductor's FX graph cache does not key on the hook: a graph cached by a process
without it keeps its looped kernels.

Reordered output features: a family whose attention reads q's and k's features in an order that
compiles badly (Flux's rotary embedding rotates neighbouring pairs) can reorder the rows of the q
and k projections once, with `reorder_outputs`, where q.k is the same under any shared order.
"""

from __future__ import annotations

import math

import torch
from diffusers.models.activations import GELU as DiffusersGELU
from torch._inductor.choices import InductorChoices

from .kernels.fp8_layers import Fp8Linear
from .kernels.int8 import Int8Linear

# The widest row whose reduction keeps it in registers (see above); inductor's own bound is 1024.
PERSISTENT_ROW_MAX = 2048

# The widest head that torch's flash and cuDNN attention kernels take.
FUSED_ATTENTION_MAX_HEAD_DIM = 256


class ChannelStatisticsGroupNorm(torch.nn.GroupNorm):
    """torch.nn.GroupNorm with its statistics reduced per channel, then per group (see above)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, channels = x.shape[:2]
        pixels = tuple(range(2, x.dim()))
        over_pixels = (slice(None), slice(None)) + (None,) * len(pixels)
        values = x.float()
        variance, mean = torch.var_mean(values, dim=pixels, correction=0)
        variance = variance.view(batch, self.num_groups, -1)
        mean = mean.view(batch, self.num_groups, -1)
        group_mean = mean.mean(-1, keepdim=True)
        group_variance = variance.mean(-1, keepdim=True) + (mean - group_mean).square().mean(-1, keepdim=True)
        channels_per_group = channels // self.num_groups
        center = group_mean.expand(-1, -1, channels_per_group).reshape(batch, channels)
        inverse_std = torch.rsqrt(group_variance + self.eps).expand(-1, -1, channels_per_group).reshape(batch, channels)
        y = (values - center[over_pixels]) * inverse_std[over_pixels]
        if self.affine:
            y = y * self.weight.float()[(None,) + over_pixels[1:]] + self.bias.float()[(None,) + over_pixels[1:]]
        return y.to(x.dtype)


class SigmoidTanhGELU(torch.nn.GELU):
    """torch.nn.GELU(approximate="tanh") computed through a sigmoid (see above)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tanh_gelu(x)


def tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation, x * 0.5 * (1 + tanh(z)), as x * sigmoid(2z), in fp32 or finer."""
    values = x.to(torch.promote_types(x.dtype, torch.float32))
    z = math.sqrt(2 / math.pi) * (values + 0.044715 * values * values * values)
    return (values * torch.sigmoid(2 * z)).to(x.dtype)


class SigmoidTanhGELUProjection(DiffusersGELU):
    """diffusers' projection+GELU layer with approximate="tanh", its GELU computed as above."""

    def gelu(self, gate: torch.Tensor) -> torch.Tensor:
        return tanh_gelu(gate)


def use_sigmoid_gelu(module: torch.nn.Module) -> None:
    """Gives `module`'s tanh-approximated GELUs (torch's, and diffusers' projection+GELU layers)
    the sigmoid form above, in place."""
    forms = {torch.nn.GELU: SigmoidTanhGELU, DiffusersGELU: SigmoidTanhGELUProjection}
    for layer in module.modules():
        if type(layer) in forms and layer.approximate == "tanh":
            # Same parameters and state: only the forward differs.
            layer.__class__ = forms[type(layer)]


# Per Linear layer class the torch backend runs, its tensors with a row per output feature (a scale
# of one element is the whole tensor's, and stays).
OUTPUT_ROWS = {torch.nn.Linear: ("weight", "bias"), Fp8Linear: ("weight_fp8", "weight_scale", "bias"),
               Int8Linear: ("weight_int8", "output_scale", "bias")}


def reorder_outputs(layer: torch.nn.Module, order: torch.Tensor) -> None:
    """Makes `layer` (one of OUTPUT_ROWS' classes) give output feature order[i] as its feature i, in place."""
    for name in OUTPUT_ROWS[type(layer)]:
        tensor = getattr(layer, name)
        if tensor is not None and tensor.numel() > 1:
            # Through bytes of the same width: not every device can index FP8 tensors.
            rows = tensor.data.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor.data
            tensor.data = rows.index_select(0, order.to(rows.device)).view(tensor.dtype)


def _channels_last(value):
    """`value` with each 4-D tensor in it pinned to channels-last memory (nested tuples followed)."""
    if isinstance(value, torch.Tensor) and value.dim() == 4:
        _, channels, height, width = value.shape
        strides = (channels * height * width, 1, width * channels, channels)
        return torch.ops.prims.inductor_force_stride_order(value, strides)
    if type(value) is tuple:
        return tuple(_channels_last(item) for item in value)
    return value


def _pin_output(module, args, output):
    # Only the compiler needs telling: eager kernels already leave these outputs channels-last.
    # The stride-order op has no gradient, and the torch backend compiles for inference only.
    pin = torch.compiler.is_compiling() and not torch.is_grad_enabled()
    return _channels_last(output) if pin else None


def pin_channels_last_outputs(module: torch.nn.Module) -> None:
    """Makes the compiler lay out, channels-last, the 4-D outputs of every block inside `module`
    (each submodule that has submodules of its own: ResNets, transformer and up/down blocks,
    resamplers), as above. Layers are left alone, so a norm's output still fuses into its reader."""
    for name, block in module.named_modules():
        if name and next(block.children(), None) is not None:
            block.register_forward_hook(_pin_output)


def _wide_headed(attn) -> bool:
    return attn.inner_dim // attn.heads > FUSED_ATTENTION_MAX_HEAD_DIM


def use_compiled_forms(module: torch.nn.Module) -> None:
    """Gives `module`'s GroupNorms and its attention layers with wide heads the forms above, in place."""
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0, SlicedAttnProcessor

    for layer in module.modules():
        if type(layer) is torch.nn.GroupNorm:
            # Same parameters and state: only the forward differs.
            layer.__class__ = ChannelStatisticsGroupNorm
        elif isinstance(layer, Attention) and type(layer.processor) is AttnProcessor2_0 and _wide_headed(layer):
            layer.set_processor(SlicedAttnProcessor(slice_size=1))


class PersistentRows(InductorChoices):
    """Inductor's choices, but rows of up to PERSISTENT_ROW_MAX elements reduced in registers
    (see above)."""

    @staticmethod
    def should_use_persistent_reduction(features, cooperative_reduction: bool) -> bool:
        from torch._inductor import config
        from torch._inductor.runtime.hints import ReductionHint
        from torch._inductor.virtualized import V

        if (config.triton.persistent_reductions and not cooperative_reduction
                and features.get_reduction_hint() == ReductionHint.INNER
                and V.graph.sizevars.statically_known_leq(features.reduction_numel, PERSISTENT_ROW_MAX)):
            return True
        return InductorChoices.should_use_persistent_reduction(features, cooperative_reduction)


def use_persistent_rows() -> None:
    """Makes inductor reduce rows of up to PERSISTENT_ROW_MAX elements in registers in what this
    thread compiles from now on (see above)."""
    from torch._inductor.virtualized import V

    V.set_choices_handler(PersistentRows())
