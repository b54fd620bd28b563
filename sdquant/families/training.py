"""What the families' scene-training losses share: mixed precision on GPUs and which captions of a
batch stay (the rest are dropped, so that guidance works at sampling time)."""

from __future__ import annotations

import torch


def autocast(device: torch.device):
    """bf16 autocast on a GPU; a CPU smoke run trains in fp32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def kept(block, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Per sample of a batch, whether its caption stays (the rest are dropped for guidance)."""
    return torch.rand(block.batch_size, device=device, generator=generator) >= block.empty_caption_rate
