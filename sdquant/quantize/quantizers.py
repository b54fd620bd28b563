"""What a quantized UNet's enabled quantizers are, read from its ModelOpt modules: per Conv and
Linear layer its weight and input ranges and number format, the attention layers ModelOpt runs in
FP8, and any quantizer of another kind. The export writes Q/DQ pairs from these, and the torch
backend FP8 kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantizedInput:
    """One enabled weight or input quantizer of a Conv or Linear layer, as the graph needs it."""

    layer: str       # the layer's state-dict prefix in the traced module
    role: str        # "weight" or "input"
    amax: torch.Tensor
    fp8: bool


@dataclass
class QuantizedAttention:
    """An attention layer whose q/k/v quantizers are all FP8: ModelOpt's FP8 attention."""

    layer: str
    amax: dict[str, torch.Tensor]  # q, k, v


ATTENTION_ROLES = ("q", "k", "v")


def _quantizers(module, names: tuple[str, ...]) -> dict[str, object]:
    from modelopt.torch.quantization.nn import TensorQuantizer

    return {name: q for name in names if isinstance(q := getattr(module, f"{name}_quantizer", None), TensorQuantizer)}


def is_fp8_attention(module) -> bool:
    """ModelOpt's rule: FP8 attention only when the q, k and v quantizers are all on and FP8."""
    quantizers = _quantizers(module, tuple(f"{role}_bmm" for role in ATTENTION_ROLES))
    return len(quantizers) == 3 and all(q.is_enabled and isinstance(q.num_bits, tuple) for q in quantizers.values())


def unsupported_quantizers(root: torch.nn.Module) -> list[str]:
    """Enabled quantizers the export does not write itself (such as output quantizers): ModelOpt
    writes those while tracing, so their graph is traced on real tensors."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    # Softmax's range is fixed at 1 in ModelOpt's FP8 attention, which ignores its quantizer.
    written = (".weight_quantizer", ".input_quantizer", ".softmax_quantizer",
               *(f".{role}_bmm_quantizer" for role in ATTENTION_ROLES))
    return [name for name, module in root.named_modules()
            if isinstance(module, TensorQuantizer) and module.is_enabled and not name.endswith(written)]


def quantized_inputs(root: torch.nn.Module) -> list[QuantizedInput]:
    sites = []
    for name, module in root.named_modules():
        for role, quantizer in _quantizers(module, ("weight", "input")).items():
            if quantizer.is_enabled:
                sites.append(QuantizedInput(name, role, quantizer.amax.detach().float().cpu(),
                                            fp8=isinstance(quantizer.num_bits, tuple)))
    return sites


def quantized_attention(root: torch.nn.Module) -> list[QuantizedAttention]:
    return [QuantizedAttention(name, {role: getattr(module, f"{role}_bmm_quantizer").amax.detach().float().cpu()
                                      for role in ATTENTION_ROLES})
            for name, module in root.named_modules() if is_fp8_attention(module)]
