"""Each quant level turns on exactly the intended quantizers, and the exclusion filter always wins."""

from __future__ import annotations

import collections

import modelopt.torch.quantization as mtq
import pytest
import torch.nn as nn
from modelopt.torch.quantization.nn import TensorQuantizer

from sdquant.families.sd import SDXL
from sdquant.quantize.recipe import is_enabled

EXCLUDED = ("time_embedding", "time_emb_proj", "add_embedding", "conv_in", "conv_out", "conv_shortcut")


def _kind(module_name: str, module: nn.Module) -> str | None:
    if any(part in module_name for part in EXCLUDED):
        return "excluded"
    if isinstance(module, nn.Conv2d):
        return "conv"
    if isinstance(module, nn.Linear):
        if ".ff.net." in module_name:
            return "ffn"
        if module_name.rsplit(".", 1)[-1] in ("to_q", "to_k", "to_v"):
            return "qkv"
        return "other_linear"
    return None


def _module_kinds(unet) -> collections.Counter:
    return collections.Counter(k for n, m in unet.named_modules() if (k := _kind(n, m)))


def _enabled_by_kind(unet) -> collections.Counter:
    modules = dict(unet.named_modules())
    counts = collections.Counter()
    for name, quantizer in unet.named_modules():
        if isinstance(quantizer, TensorQuantizer) and quantizer.is_enabled:
            owner_name, quantizer_kind = name.rsplit(".", 1)
            if quantizer_kind in ("weight_quantizer", "input_quantizer"):
                counts[(_kind(owner_name, modules[owner_name]), quantizer_kind)] += 1
            else:
                counts[("attention", quantizer_kind)] += 1
    return counts


EXPECTED_KINDS = {
    1.0: ("conv",),
    2.0: ("conv", "ffn"),
    2.5: ("conv", "ffn", "qkv"),
    3.0: ("conv", "ffn", "qkv", "other_linear"),
    4.0: ("conv", "ffn", "qkv", "other_linear"),
}


@pytest.mark.parametrize("fmt,level", [("int8", 1.0), ("int8", 2.0), ("int8", 2.5), ("int8", 3.0),
                                       ("fp8", 2.5), ("fp8", 4.0)])
def test_level_enables_exactly_its_layers(tiny_pipeline, fmt, level):
    unet = tiny_pipeline().unet
    kinds = _module_kinds(unet)
    assert kinds["excluded"] > 0 and kinds["other_linear"] > 0, "the tiny UNet must hold every kind"
    mtq.quantize(unet, {"quant_cfg": SDXL.quant_cfg_entries(fmt, level), "algorithm": None})
    enabled = _enabled_by_kind(unet)

    expected = collections.Counter()
    for kind in EXPECTED_KINDS[level]:
        expected[(kind, "weight_quantizer")] = kinds[kind]
        expected[(kind, "input_quantizer")] = kinds[kind]
    if level == 4.0:
        # FP8 attention is self-attention's only: cross-attention's 77 keys stay in 16 bits.
        attention_modules = sum(1 for n, _ in unet.named_modules() if n.endswith(".attn1"))
        for quantizer in ("q_bmm_quantizer", "k_bmm_quantizer", "v_bmm_quantizer", "softmax_quantizer"):
            expected[("attention", quantizer)] = attention_modules
    assert enabled == expected


def test_filter_wins_over_level(tiny_pipeline):
    unet = tiny_pipeline().unet
    entries = SDXL.quant_cfg_entries("int8", 3.0)
    # Even a config that explicitly asks for the excluded layers earlier in the list must lose.
    entries.insert(1, {"quantizer_name": "*conv_in*", "cfg": {"num_bits": 8, "axis": None}})
    mtq.quantize(unet, {"quant_cfg": entries, "algorithm": None})
    for name, module in unet.named_modules():
        if isinstance(module, TensorQuantizer) and any(part in name for part in EXCLUDED):
            assert not module.is_enabled, name


@pytest.mark.parametrize("fmt,level", [("int8", 1.0), ("int8", 2.0), ("int8", 2.5), ("int8", 3.0), ("fp8", 4.0)])
def test_calibration_hooks_read_the_recipe_as_modelopt_does(tiny_pipeline, fmt, level):
    """Calibration hooks the layers before ModelOpt inserts quantizers; both must pick the same."""
    unet = tiny_pipeline().unet
    entries = SDXL.quant_cfg_entries(fmt, level)
    layer_kinds = ("input_quantizer", "weight_quantizer")
    attention_kinds = ("q_bmm_quantizer", "k_bmm_quantizer", "v_bmm_quantizer", "softmax_quantizer")
    ours = set()
    for name, module in unet.named_modules():
        kinds = layer_kinds if isinstance(module, (nn.Conv2d, nn.Linear)) else (
            attention_kinds if hasattr(module, "to_q") else ())
        ours |= {f"{name}.{kind}" for kind in kinds if is_enabled(entries, f"{name}.{kind}", module)}
    mtq.quantize(unet, {"quant_cfg": entries, "algorithm": None})
    theirs = {name for name, module in unet.named_modules()
              if isinstance(module, TensorQuantizer) and module.is_enabled}
    assert ours == theirs
