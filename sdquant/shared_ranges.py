"""Quantized layers of an attention block that share one FP8 range, so that the torch backend can run
them as one kernel: the q/k/v projections that read one input (one FP8 GEMM over their stacked
weights, which then take the largest of their weight ranges, as ModelOpt and TensorRT-LLM do for
fused QKV), and the image and text output projections of a joint FP8 attention (Flux's double
blocks), which read one FP8 output tensor and so one scale.

quantize.py ties these ranges after calibrating FP8 (``tie_fp8_ranges``), so ModelOpt's fake
quantization, the export and the torch backend's FP8 kernels all compute with the same numbers.
"""

from __future__ import annotations

import torch

from .quantizers import is_fp8_attention


def _attention_classes() -> tuple[type, type]:
    from diffusers.models.attention_processor import Attention
    from diffusers.models.transformers.transformer_flux import FluxAttention

    return Attention, FluxAttention


def attention_layers(root: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The UNet (Attention) and Flux (FluxAttention) attention layers of `root`, by name."""
    classes = _attention_classes()
    return [(name, module) for name, module in root.named_modules() if isinstance(module, classes)]


# Projections that read one input, and the name diffusers gives their fused layer.
QKV = (("to_q", "to_k", "to_v"), "to_qkv")
KV = (("to_k", "to_v"), "to_kv")
ADDED_QKV = (("add_q_proj", "add_k_proj", "add_v_proj"), "to_added_qkv")


def projection_groups(attention: torch.nn.Module) -> list[tuple[tuple[str, ...], str]]:
    """The groups of projections of `attention` that read one input: q, k and v of self-attention
    and of each stream of a joint attention; k and v of cross-attention."""
    attention_class, flux_class = _attention_classes()
    if isinstance(attention, flux_class):
        return [QKV, ADDED_QKV] if attention.added_kv_proj_dim is not None else [QKV]
    if isinstance(attention, attention_class):
        return [KV] if attention.is_cross_attention else [QKV]
    return []


def output_groups(attention: torch.nn.Module) -> list[tuple[str, ...]]:
    """The layers that read one attention output tensor: a joint attention's image and text
    output projections."""
    # diffusers' attention classes hold to_add_out = None where there is no text stream.
    return [("to_out.0", "to_add_out")] if isinstance(getattr(attention, "to_add_out", None), torch.nn.Module) else []


def _tie(quantizers: list) -> bool:
    """Gives every quantizer the largest of their ranges, where all are enabled per-tensor FP8."""
    if not all(q.is_enabled and isinstance(q.num_bits, tuple) and q.amax is not None and q.amax.numel() == 1
               for q in quantizers):
        return False
    shared = torch.stack([q.amax.detach().reshape(()) for q in quantizers]).max()
    for quantizer in quantizers:
        quantizer.amax = shared.clone().reshape(quantizer.amax.shape)
    return True


def tie_fp8_ranges(backbone: torch.nn.Module) -> int:
    """Ties, in place, the weight ranges of each projection group and, where the attention is FP8,
    the input ranges of its output group; returns how many groups were tied. INT8 ranges (per
    channel) are left as they are."""
    tied = 0
    for _, attention in attention_layers(backbone):
        for names, _ in projection_groups(attention):
            tied += _tie([attention.get_submodule(name).weight_quantizer for name in names])
        if is_fp8_attention(attention):
            for names in output_groups(attention):
                tied += _tie([attention.get_submodule(name).input_quantizer for name in names])
    return tied
