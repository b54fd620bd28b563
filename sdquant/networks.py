"""What a network of a pipeline is: its graph name, its inputs and outputs with their dynamic axes,
and where its ONNX file lives. Each family (sdquant.families) lists its networks; export writes
these names and axes, build sizes the axes into engine profiles, and the stages call the networks
by them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path


class Family(str, Enum):
    sdxl = "sdxl"
    sd15 = "sd15"
    sd2 = "sd2"
    flux = "flux"


# CLIP's window: every CLIP text encoder graph takes this many token ids per sample.
TOKENS = 77

# The labels of the dynamic axes, as the ONNX graphs carry them: batch, latent height and width,
# the UNet's CLIP context (one window per prompt chunk), a DiT's packed image tokens and its text
# tokens.
BATCH, HEIGHT, WIDTH, CONTEXT, IMAGE_TOKENS, TEXT_TOKENS = "B", "H", "W", "S", "L", "T"
LATENT = {0: BATCH, 2: HEIGHT, 3: WIDTH}


@dataclass(frozen=True)
class Network:
    """A graph's name, and each input's and output's dynamic axes ({axis: label}), in graph order."""

    name: str
    inputs: dict[str, dict[int, str]]
    outputs: dict[str, dict[int, str]]
    # Inputs the exporter leaves out of a graph that never reads them (DeepCache's shallow pass
    # reads no text where its live blocks have no cross-attention).
    optional: tuple[str, ...] = ()

    @property
    def input_names(self) -> list[str]:
        return list(self.inputs)

    @property
    def required_inputs(self) -> list[str]:
        return [name for name in self.inputs if name not in self.optional]

    @property
    def output_names(self) -> list[str]:
        return list(self.outputs)

    @property
    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        return {**self.inputs, **self.outputs}


VAE = Network("vae", {"latent": LATENT}, {"images": LATENT})

ONNX_FILE = "model.onnx"


def onnx_path(out_path: str | Path, name: str) -> Path:
    return Path(out_path).expanduser() / "onnx" / name / ONNX_FILE
