"""Quantized layers of an attention block that share one FP8 range, so that the torch backend can run
them as one kernel: the q/k/v projections that read one input (one FP8 GEMM over their stacked
weights, which then take the largest of their weight ranges, as ModelOpt and TensorRT-LLM do for
fused QKV), and the image and text output projections of a joint FP8 attention (Flux's double
blocks), which read one FP8 output tensor and so one scale.

quantize.py ties these ranges after calibrating FP8 (``tie_fp8_ranges``), so ModelOpt's fake
quantization, the export and the torch backend's FP8 kernels all compute with the same numbers. The
family says what its attention layers call these layers (ModelFamily.attention_projections).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .quantizers import is_fp8_attention

# Projections that read one input, by name, and the name of their fused layer.
Group = tuple[tuple[str, ...], str]


@dataclass(frozen=True)
class AttentionProjections:
    """What a family's attention layers call the layers that share a range: the projections that read
    one input (a self-attention's q, k and v; a cross-attention's k and v, its q reading the image; a
    joint attention's text stream's added q, k and v), and the projections that read one attention
    output (the image's, and a joint attention's text stream's)."""

    qkv: Group
    kv: Group
    added_qkv: Group
    output: str
    added_output: str


def attention_layers(root: torch.nn.Module, names: AttentionProjections) -> list[tuple[str, torch.nn.Module]]:
    """The attention layers of `root` by name: its attention modules, whatever their class, with their
    q, k and v projections as layers of their own."""
    return [(name, module) for name, module in root.named_modules()
            if all(isinstance(getattr(module, projection, None), torch.nn.Module) for projection in names.qkv[0])]


def projection_groups(attention: torch.nn.Module, names: AttentionProjections) -> list[Group]:
    """The groups of projections of `attention` that read one input: q, k and v of self-attention,
    k and v of cross-attention, and q, k and v of a joint attention's text stream."""
    groups = [names.kv] if getattr(attention, "is_cross_attention", False) else [names.qkv]
    if isinstance(getattr(attention, names.added_qkv[0][0], None), torch.nn.Module):
        groups.append(names.added_qkv)
    return groups


def output_groups(attention: torch.nn.Module, names: AttentionProjections) -> list[tuple[str, ...]]:
    """The layers that read one attention output tensor: a joint attention's image and text
    output projections."""
    # An attention without a text stream holds its added output as None.
    joint = isinstance(getattr(attention, names.added_output, None), torch.nn.Module)
    return [(names.output, names.added_output)] if joint else []


def tied_groups(names: AttentionProjections) -> dict:
    """What tie_fp8_ranges ties, as plain data for the fingerprint of the checkpoints it changes:
    the weight ranges of each projection group, the input ranges of the output group."""
    return {"weights": [names.qkv[0], names.kv[0], names.added_qkv[0]], "inputs": [[names.output, names.added_output]]}


def _tie(quantizers: list) -> bool:
    """Gives every quantizer the largest of their ranges, where all are enabled per-tensor FP8."""
    if not all(q.is_enabled and isinstance(q.num_bits, tuple) and q.amax is not None and q.amax.numel() == 1
               for q in quantizers):
        return False
    shared = torch.stack([q.amax.detach().reshape(()) for q in quantizers]).max()
    for quantizer in quantizers:
        quantizer.amax = shared.clone().reshape(quantizer.amax.shape)
    return True


def tie_fp8_ranges(backbone: torch.nn.Module, names: AttentionProjections) -> int:
    """Ties, in place, the weight ranges of each projection group and, where the attention is FP8,
    the input ranges of its output group; returns how many groups were tied. INT8 ranges (per
    channel) are left as they are."""
    tied = 0
    for _, attention in attention_layers(backbone, names):
        for layers, _ in projection_groups(attention, names):
            tied += _tie([attention.get_submodule(layer).weight_quantizer for layer in layers])
        if is_fp8_attention(attention):
            for layers in output_groups(attention, names):
                tied += _tie([attention.get_submodule(layer).input_quantizer for layer in layers])
    return tied
