"""What the families' scene training shares: its phases, mixed precision on GPUs, which captions of a
batch stay (the rest are dropped, so that guidance works at sampling time) and the check of widths
that group norms divide."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import UserError


@dataclass
class ScenePhase:
    """One phase of a scene model's training after its VAE: `modules` learn together on `loss_of`
    (random batch indices to a loss) for `steps` steps, logged as `name`; `then` runs once the
    phase's moving averages are in the weights."""

    name: str
    modules: list[torch.nn.Module]
    loss_of: Callable[[torch.Tensor], torch.Tensor]
    steps: int
    then: Callable[[], None] = lambda: None


def autocast(device: torch.device):
    """bf16 autocast on a GPU; a CPU smoke run trains in fp32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def kept(block, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Per sample of a batch, whether its caption stays (the rest are dropped for guidance)."""
    return torch.rand(block.batch_size, device=device, generator=generator) >= block.empty_caption_rate


def check_group_widths(arch, *keys: str) -> None:
    """Refuses, naming the key, widths of a scene architecture that its norm_groups do not divide."""
    for key in keys:
        widths = getattr(arch, key)
        if not widths or any(width < arch.norm_groups or width % arch.norm_groups for width in widths):
            raise UserError(f"architecture.{key}={list(widths)}: every width must be a positive multiple of "
                            f"architecture.norm_groups={arch.norm_groups}")
