"""What a graph is traced from: its network, the module that computes it and sample inputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .networks import Network


@dataclass
class GraphSpec:
    network: Network
    module: torch.nn.Module
    args: tuple
    # Traced on the meta device; the text encoders and VAE build masks and positions on their
    # inputs' device while tracing, so they are traced on their own tensors (they are small).
    on_meta: bool = False

    @property
    def name(self) -> str:
        return self.network.name

    @property
    def input_names(self) -> list[str]:
        return self.network.input_names

    @property
    def output_names(self) -> list[str]:
        return self.network.output_names
