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


def attention_layers(root: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The attention layers of `root` by name: diffusers' attention modules, whatever their class,
    with their q, k and v projections as layers of their own."""
    return [(name, module) for name, module in root.named_modules()
            if all(isinstance(getattr(module, projection, None), torch.nn.Module) for projection in QKV[0])]


# Projections that read one input, and the name diffusers gives their fused layer.
QKV = (("to_q", "to_k", "to_v"), "to_qkv")
KV = (("to_k", "to_v"), "to_kv")
ADDED_QKV = (("add_q_proj", "add_k_proj", "add_v_proj"), "to_added_qkv")
# A joint attention's image and text output projections, which read its one output tensor.
JOINT_OUTPUTS = ("to_out.0", "to_add_out")


def projection_groups(attention: torch.nn.Module) -> list[tuple[tuple[str, ...], str]]:
    """The groups of projections of `attention` that read one input: q, k and v of self-attention,
    k and v of cross-attention (q reads the image, k and v the text), and q, k and v of a joint
    attention's text stream (its added projections)."""
    groups = [KV] if getattr(attention, "is_cross_attention", False) else [QKV]
    if isinstance(getattr(attention, ADDED_QKV[0][0], None), torch.nn.Module):
        groups.append(ADDED_QKV)
    return groups


def output_groups(attention: torch.nn.Module) -> list[tuple[str, ...]]:
    """The layers that read one attention output tensor: a joint attention's image and text
    output projections."""
    # diffusers' attention classes hold to_add_out = None where there is no text stream.
    return [JOINT_OUTPUTS] if isinstance(getattr(attention, "to_add_out", None), torch.nn.Module) else []


def tied_groups() -> dict:
    """What tie_fp8_ranges ties, as plain data for the fingerprint of the checkpoints it changes:
    the weight ranges of each projection group, the input ranges of the output group."""
    return {"weights": [QKV[0], KV[0], ADDED_QKV[0]], "inputs": [JOINT_OUTPUTS]}


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
