"""What each network of a pipeline is, in one place: its graph name, its inputs and outputs with
their dynamic axes, and where its ONNX file lives. Export writes these names and axes, build sizes
the axes into engine profiles, and the stages call the networks by them.

Every graph has a dynamic batch; the UNet's and VAE's latents have a dynamic height and width, and
the UNet's ``context`` a dynamic length (one CLIP window of token embeddings per prompt chunk).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path


class Family(str, Enum):
    sdxl = "sdxl"
    sd15 = "sd15"
    sd2 = "sd2"


def is_sdxl(family) -> bool:
    return Family(family) == Family.sdxl


# CLIP's window: every text encoder graph takes this many token ids per sample.
TOKENS = 77

# The labels of the dynamic axes, as the ONNX graphs carry them.
BATCH, HEIGHT, WIDTH, CONTEXT = "B", "H", "W", "S"
_LATENT = {0: BATCH, 2: HEIGHT, 3: WIDTH}


@dataclass(frozen=True)
class Network:
    """A graph's name, and each input's and output's dynamic axes ({axis: label}), in graph order."""

    name: str
    inputs: dict[str, dict[int, str]]
    outputs: dict[str, dict[int, str]]

    @property
    def input_names(self) -> list[str]:
        return list(self.inputs)

    @property
    def output_names(self) -> list[str]:
        return list(self.outputs)

    @property
    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        return {**self.inputs, **self.outputs}


def text_encoder(name: str, pooled: bool) -> Network:
    """input_ids -> the hidden states the pipeline conditions on (and the pooled embedding)."""
    outputs = {"hidden_states": {0: BATCH}, **({"pooled": {0: BATCH}} if pooled else {})}
    return Network(name, {"input_ids": {0: BATCH}}, outputs)


def unet(sdxl: bool) -> Network:
    """x, timesteps, context and (SDXL) y, NeMo's pooled text embedding joined to the Fourier-embedded
    time ids -> the noise prediction."""
    inputs = {"x": _LATENT, "timesteps": {0: BATCH}, "context": {0: BATCH, 1: CONTEXT}}
    if sdxl:
        inputs["y"] = {0: BATCH}
    return Network(unet_graph_name(sdxl), inputs, {"out": _LATENT})


VAE = Network("vae", {"latent": _LATENT}, {"images": _LATENT})


def unet_graph_name(sdxl: bool) -> str:
    return "unet_xl" if sdxl else "unet"


def networks(family) -> list[Network]:
    """The pipeline's networks with NeMo's graph names, text encoders first."""
    if is_sdxl(family):
        return [text_encoder("clip1", pooled=False), text_encoder("clip2", pooled=True), unet(True), VAE]
    return [text_encoder("clip1", pooled=False), unet(False), VAE]


def network(family, name: str) -> Network:
    """The network of `family` whose graph is named `name`."""
    return {each.name: each for each in networks(family)}[name]


def graph_names(family) -> tuple[str, ...]:
    return tuple(network.name for network in networks(family))


def dynamic_axes(graph: str, tensor: str) -> dict[int, str]:
    """{axis: label} of the dynamic axes of input or output `tensor` of the graph named `graph`."""
    known = {network.name: network for family in Family for network in networks(family)}
    return known[graph].dynamic_axes.get(tensor, {}) if graph in known else {}


def sized(graph: str, tensor: str, shape, sizes: dict[str, int]) -> tuple:
    """`shape` with each dynamic axis of `tensor` set to the size `sizes` gives its label."""
    shape = list(shape)
    for axis, label in dynamic_axes(graph, tensor).items():
        if axis < len(shape):
            shape[axis] = sizes[label]
    return tuple(shape)


ONNX_FILE = "model.onnx"


def onnx_path(out_path: str | Path, name: str) -> Path:
    return Path(out_path).expanduser() / "onnx" / name / ONNX_FILE
