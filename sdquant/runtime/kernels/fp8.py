"""FP8 (E4M3) rounding as ModelOpt's fake quantization computes it, number for number: a tensor is
multiplied by 448 / amax in fp32, clamped to E4M3's range and rounded to float8_e4m3fn; amax / 448
dequantizes it (or goes into a GEMM or attention kernel as its scale)."""

from __future__ import annotations

import torch

FP8_MAX = 448.0


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
