"""Export stage: the pipeline's networks as ONNX graphs with NeMo's names.

``<out_path>/onnx/<name>/model.onnx`` for clip1, clip2, unet_xl (``unet`` for SD 1.5/2.x) and
vae. The UNet takes ``x``, ``timesteps``, ``context`` and (SDXL) ``y``, the pooled text
embedding joined to the Fourier-embedded time ids, which feeds the UNet's add_embedding directly.
Batch is dynamic on every graph, sequence length on ``context``, height and width on latents.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .artifacts import read_json, write_json
from .config import Family

ONNX_FILE = "model.onnx"
EXTERNAL_DATA_FILE = "model.onnx.data"
META_FILE = "export.json"
PROTOBUF_LIMIT = 2 * 1024**3
TOKENS = 77


def graph_names(family: Family) -> tuple[str, ...]:
    if Family(family) == Family.sdxl:
        return ("clip1", "clip2", "unet_xl", "vae")
    return ("clip1", "unet", "vae")


def unet_graph_name(sdxl: bool) -> str:
    return "unet_xl" if sdxl else "unet"


def onnx_path(out_path: str | Path, name: str) -> Path:
    return Path(out_path).expanduser() / "onnx" / name / ONNX_FILE


def sdxl_y(unet, pooled: torch.Tensor, time_ids: torch.Tensor) -> torch.Tensor:
    """NeMo's ``y``: the pooled text embedding joined to the Fourier-embedded time ids."""
    fourier = unet.add_time_proj(time_ids.flatten()).reshape(pooled.shape[0], -1)
    return torch.cat([pooled, fourier.to(pooled.dtype)], dim=-1)


class TextEncoderGraph(torch.nn.Module):
    """input_ids -> the hidden states the pipeline conditions on (and the pooled embedding)."""

    def __init__(self, encoder, penultimate: bool, pooled: bool):
        super().__init__()
        # The exporter's SDPA symbolic adds an fp32 causal mask, which turns an fp16 graph into a
        # mix of types ONNX Runtime and strongly typed TensorRT refuse; eager attention writes
        # the mask and softmax out in the model's own types.
        encoder.set_attn_implementation("eager")
        self.encoder = encoder
        self.penultimate = penultimate
        self.pooled = pooled

    def forward(self, input_ids):
        out = self.encoder(input_ids, output_hidden_states=True)
        hidden = out.hidden_states[-2] if self.penultimate else out.last_hidden_state
        return (hidden, out.text_embeds) if self.pooled else hidden


@contextlib.contextmanager
def y_conditioning(unet):
    """Makes the SDXL UNet take ``y`` as its add_embedding input, as NeMo's graph does."""

    def aug_embed_from_y(self, emb, encoder_hidden_states, added_cond_kwargs):
        return self.add_embedding(added_cond_kwargs["y"].to(emb.dtype))

    unet.get_aug_embed = types.MethodType(aug_embed_from_y, unet)
    try:
        yield unet
    finally:
        del unet.get_aug_embed


class UNetGraph(torch.nn.Module):
    def __init__(self, unet, sdxl: bool):
        super().__init__()
        self.unet = unet
        self.sdxl = sdxl

    def forward(self, x, timesteps, context, y=None):
        if not self.sdxl:
            return self.unet(x, timesteps, encoder_hidden_states=context, return_dict=False)[0]
        with y_conditioning(self.unet):
            return self.unet(x, timesteps, encoder_hidden_states=context, added_cond_kwargs={"y": y},
                             return_dict=False)[0]


class VaeDecoderGraph(torch.nn.Module):
    """latent -> image in [-1, 1], with the pipeline's latent scaling inside the graph."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, latent):
        return self.vae.decode(latent / self.vae.config.scaling_factor, return_dict=False)[0]


@dataclass
class GraphSpec:
    name: str
    module: torch.nn.Module
    args: tuple
    input_names: list[str]
    output_names: list[str]
    dynamic_axes: dict


def _latent_axes() -> dict:
    return {0: "B", 2: "H", 3: "W"}


def graph_specs(pipe, family: Family, batch: int, latent: int, dtype: torch.dtype,
                vae_dtype: torch.dtype) -> list[GraphSpec]:
    """What to trace for each graph: the module, dummy inputs and names. The UNet is last so the
    memory its trace takes is not held while the others export."""
    sdxl = Family(family) == Family.sdxl
    ids = torch.zeros(batch, TOKENS, dtype=torch.int32)
    token_axes = {"input_ids": {0: "B"}}
    specs = [GraphSpec("clip1", TextEncoderGraph(pipe.text_encoder.to(dtype), penultimate=sdxl, pooled=False),
                       (ids,), ["input_ids"], ["hidden_states"],
                       {**token_axes, "hidden_states": {0: "B"}})]
    if sdxl:
        specs.append(GraphSpec("clip2", TextEncoderGraph(pipe.text_encoder_2.to(dtype), penultimate=True, pooled=True),
                               (ids,), ["input_ids"], ["hidden_states", "pooled"],
                               {**token_axes, "hidden_states": {0: "B"}, "pooled": {0: "B"}}))
    vae = pipe.vae.to(vae_dtype)
    specs.append(GraphSpec("vae", VaeDecoderGraph(vae), (torch.randn(batch, 4, latent, latent, dtype=vae_dtype),),
                           ["latent"], ["images"], {"latent": _latent_axes(), "images": _latent_axes()}))
    unet = pipe.unet.to(dtype)
    context_width = unet.config.cross_attention_dim
    args = [torch.randn(batch, 4, latent, latent, dtype=dtype), torch.full((batch,), 500.0),
            torch.randn(batch, TOKENS, context_width, dtype=dtype)]
    names = ["x", "timesteps", "context"]
    axes = {"x": _latent_axes(), "timesteps": {0: "B"}, "context": {0: "B", 1: "S"}, "out": _latent_axes()}
    if sdxl:
        args.append(torch.randn(batch, unet.config.projection_class_embeddings_input_dim, dtype=dtype))
        names.append("y")
        axes["y"] = {0: "B"}
    specs.append(GraphSpec(unet_graph_name(sdxl), UNetGraph(unet, sdxl), tuple(args), names, ["out"], axes))
    return specs


def prepare_quantizers_for_export(unet, dtype: torch.dtype) -> None:
    """Q/DQ scales in the graph's own precision, so the graph is fp16 + 8-bit throughout."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    high_precision = "Half" if dtype == torch.float16 else "Float"
    for module in unet.modules():
        if isinstance(module, TensorQuantizer):
            module.trt_high_precision_dtype = high_precision


def _tensors(graph):
    """Every tensor of a graph: initializers and those held in node attributes (constants)."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            for subgraph in (*([attribute.g] if attribute.HasField("g") else []), *attribute.graphs):
                yield from _tensors(subgraph)


def _save_onnx(exported: Path, final_file: Path) -> None:
    """Moves a traced graph into place. Past protobuf's 2 GB the exporter writes one file per
    tensor; those are streamed into one external-data file beside the graph, a tensor at a
    time, so the weights are never held in memory at once."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo

    model = onnx.load(str(exported), load_external_data=False)
    external = [t for t in _tensors(model.graph) if t.data_location == onnx.TensorProto.EXTERNAL]
    if not external:
        shutil.move(str(exported), str(final_file))
    else:
        with open(final_file.parent / EXTERNAL_DATA_FILE, "wb") as data:
            for tensor in external:
                info = ExternalDataInfo(tensor)
                with open(exported.parent / info.location, "rb") as source:
                    source.seek(info.offset or 0)
                    payload = source.read(info.length) if info.length else source.read()
                offset = data.tell()
                data.write(payload)
                del tensor.external_data[:]
                for key, value in (("location", EXTERNAL_DATA_FILE), ("offset", offset), ("length", len(payload))):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = key, str(value)
        onnx.save_model(model, str(final_file))
    del model
    onnx.checker.check_model(str(final_file))


def export_graph(spec: GraphSpec, folder: Path, opset: int, meta: dict) -> None:
    """Traces `spec` into `folder` atomically: everything is written beside it, then renamed."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        traced = staging / "trace"
        traced.mkdir()
        start = time.perf_counter()
        with torch.no_grad(), warnings.catch_warnings():
            # diffusers' shape asserts are constant under the trace; the graph stays dynamic.
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            torch.onnx.export(spec.module, spec.args, str(traced / ONNX_FILE), input_names=spec.input_names,
                              output_names=spec.output_names, dynamic_axes=spec.dynamic_axes,
                              opset_version=opset, dynamo=False, do_constant_folding=True)
        final = staging / "final"
        final.mkdir()
        _save_onnx(traced / ONNX_FILE, final / ONNX_FILE)
        write_json(final / META_FILE, {**meta, "seconds": round(time.perf_counter() - start, 2)})
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(final, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def is_current(folder: Path, fingerprint: str) -> bool:
    meta = read_json(folder / META_FILE)
    return meta is not None and meta.get("fingerprint") == fingerprint and (folder / ONNX_FILE).is_file()
