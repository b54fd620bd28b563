"""What one network of a pipeline is as a graph: its name, inputs and outputs with their dynamic
axes, its role in the pipeline, and the shape of each tensor once its axes are sized. A family
describes its own networks (two families may each have a `transformer` of another shape) and
sizes their axes; export, the engine builder and the runtimes ask the network, never a table
shared across families.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

# CLIP's window: every CLIP text encoder graph takes this many token ids per sample.
TOKENS = 77

# Axis labels several families share, as the ONNX graphs carry them: the batch, the latent's frames,
# height and width, a UNet's CLIP context (one window per prompt chunk) and a text encoder's tokens.
# A family names its own others (a DiT's packed image tokens, a cached pass's feature).
BATCH, FRAMES, HEIGHT, WIDTH, CONTEXT, TEXT_TOKENS = "B", "F", "H", "W", "S", "T"
LATENT = {0: BATCH, 2: HEIGHT, 3: WIDTH}
# A video's latent: (batch, channels, frames, height, width).
VIDEO_LATENT = {0: BATCH, 2: FRAMES, 3: HEIGHT, 4: WIDTH}


class Role(str, Enum):
    """What a network does in the pipeline, which decides how the runtimes treat it: backbones and
    (where the family says so) the decoder are compiled and replayed as CUDA graphs, text encoders
    run once per prompt batch."""

    text = "text"
    backbone = "backbone"
    decoder = "decoder"


@dataclass(frozen=True)
class Network:
    """A graph's name, and each input's and output's dynamic axes ({axis: label}), in graph order."""

    name: str
    inputs: dict[str, dict[int, str]]
    outputs: dict[str, dict[int, str]]
    role: Role = Role.text
    # Sees two samples per image under classifier-free guidance (negative and positive prompt).
    guided: bool = False
    # Inputs the exporter leaves out of a graph that never reads them (a transformer without the
    # guidance embedding, a UNet pass whose live blocks read no text).
    optional: tuple[str, ...] = ()
    # Float inputs a torch stage hands over in the precision the pipeline gives them rather than the
    # model's (a timestep whose embedding reads it in fp32: bf16 rounds t near 1000 by up to 4).
    kept_precision: tuple[str, ...] = ()
    # Traced at fixed sizes (its model takes sizes from its input's shape as plain integers): its
    # graph and engine take only the shapes it was traced at, and its axes are labelled so that a
    # run is checked against them before any work.
    fixed: bool = False

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

    def sized(self, tensor: str, shape, sizes: dict[str, int]) -> tuple:
        """`shape` of input or output `tensor` with each dynamic axis set to the size `sizes` gives
        its label (a label `sizes` lacks keeps the shape's own value)."""
        shape = list(shape)
        for axis, label in self.dynamic_axes.get(tensor, {}).items():
            if axis < len(shape) and label in sizes:
                shape[axis] = sizes[label]
        return tuple(shape)


VAE = Network("vae", {"latent": LATENT}, {"images": LATENT}, role=Role.decoder)
