"""The peer's quality: torchao's dynamic FP8 on a backbone's Linear layers, on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch


# torchao is the peers extra, not the dev one: with it installed, ModelOpt imports it, and on a CPU its
# import logs lines ahead of the scripts' one-line refusals.
pytest.importorskip("torchao", reason="torchao (pip install -e \".[peers]\") is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import peer_quality  # noqa: E402


def e4m3_per_row(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's per-row FP8 of bf16 `values`: each row's scale its largest magnitude over e4m3's
    largest (448), divided in bf16; the row divided by it in fp32, clamped, rounded to e4m3."""
    largest = torch.finfo(torch.float8_e4m3fn).max
    scale = (values.abs().amax(dim=-1, keepdim=True) / largest).float()
    return (values.float() / scale).clamp(-largest, largest).to(torch.float8_e4m3fn).float(), scale


def test_torchao_turns_the_linear_layers_into_per_row_fp8_between_casts():
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.LayerNorm(96),
                                   torch.nn.Linear(96, 32))
    inputs = torch.randn(5, 64) * 3
    first = backbone[0]
    weight_bf16, bias, dense = first.weight.detach().to(torch.bfloat16), first.bias.detach().clone(), first(inputs)
    record = peer_quality.torchao_linear_layers(backbone, torch.float32)
    assert record["fp8_linear_layers"] == record["linear_layers"] == 2
    assert backbone[2].weight.dtype == torch.float32, "only the Linear layers change"
    hidden = first(inputs)
    assert hidden.dtype == torch.float32
    # The arithmetic written out: the bf16 input and weight each in per-row FP8, their product in
    # fp32 times both scales, plus the bias, rounded to bf16 (2^-8 of the value at most).
    activation, activation_scale = e4m3_per_row(inputs.to(torch.bfloat16))
    weight, weight_scale = e4m3_per_row(weight_bf16)
    expected = (activation @ weight.T) * activation_scale * weight_scale.T + bias.to(torch.bfloat16).float()
    assert torch.allclose(hidden, expected, rtol=2 ** -7, atol=1e-4)
    assert (hidden - dense).abs().mean() > 5 * (hidden - expected).abs().mean(), "FP8's rounding shows"
