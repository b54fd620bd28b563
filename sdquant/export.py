"""Export stage: the pipeline's networks as ONNX graphs with NeMo's names.

``<out_path>/onnx/<name>/model.onnx`` for clip1, clip2, unet_xl (``unet`` for SD 1.5/2.x) and
vae. The UNet takes ``x``, ``timesteps``, ``context`` and (SDXL) ``y``, the pooled text
embedding joined to the Fourier-embedded time ids, which feeds the UNet's add_embedding directly.
Batch is dynamic on every graph, sequence length on ``context``, height and width on latents.

Every graph is traced with its weights as graph inputs, which are then written once, straight
from the model's tensors, as initializers. The UNet is traced on the meta device: the trace then
computes nothing and copies no weight, which is what lets a full-size SDXL UNet export in well
under a minute and a few GB on a CPU host. Its ModelOpt quantizers are switched off for that
trace and their QuantizeLinear/DequantizeLinear pairs are written into the graph afterwards from
their calibrated ranges, with the scales and types ModelOpt's own ONNX export gives them.
"""

from __future__ import annotations

import collections
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
from .errors import UserError

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


def graph_files(onnx_file: Path) -> list[Path]:
    """The graph and, for one past protobuf's limit, its external-data file."""
    data = onnx_file.parent / EXTERNAL_DATA_FILE
    return [onnx_file, data] if data.is_file() else [onnx_file]


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
    # The Fourier time embedding builds its frequencies with arange on the timesteps' device: on
    # the meta device they would have no values, so for a meta trace the timesteps stay on the CPU
    # and only their embedding moves to meta.
    host_inputs = ("timesteps",)

    def __init__(self, unet, sdxl: bool):
        super().__init__()
        self.unet = unet
        self.sdxl = sdxl

    def host_modules(self) -> list[torch.nn.Module]:
        return [self.unet.time_proj]

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
    # Traced on the meta device; the text encoders and VAE build masks and positions on their
    # inputs' device while tracing, so they are traced on their own tensors (they are small).
    on_meta: bool = False


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
    specs.append(GraphSpec(unet_graph_name(sdxl), UNetGraph(unet, sdxl), tuple(args), names, ["out"], axes,
                           on_meta=not unsupported_quantizers(unet)))
    return specs


def prepare_quantizers_for_export(unet, dtype: torch.dtype) -> None:
    """Q/DQ scales in the graph's own precision, so the graph is fp16 + 8-bit throughout."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    high_precision = "Half" if dtype == torch.float16 else "Float"
    for module in unet.modules():
        if isinstance(module, TensorQuantizer):
            module.trt_high_precision_dtype = high_precision


@dataclass
class QuantizedInput:
    """One enabled weight or input quantizer of a Conv or Linear layer, as the graph needs it."""

    layer: str       # the layer's state-dict prefix in the traced module
    role: str        # "weight" or "input"
    amax: torch.Tensor
    fp8: bool


@dataclass
class QuantizedAttention:
    """An attention layer whose q/k/v quantizers are all FP8: ModelOpt's FP8 attention."""

    layer: str
    amax: dict[str, torch.Tensor]  # q, k, v


ATTENTION_ROLES = ("q", "k", "v")


def _quantizers(module, names: tuple[str, ...]) -> dict[str, object]:
    from modelopt.torch.quantization.nn import TensorQuantizer

    return {name: q for name in names if isinstance(q := getattr(module, f"{name}_quantizer", None), TensorQuantizer)}


def _fp8_attention(module) -> bool:
    """ModelOpt's rule: FP8 attention only when the q, k and v quantizers are all on and FP8."""
    quantizers = _quantizers(module, tuple(f"{role}_bmm" for role in ATTENTION_ROLES))
    return len(quantizers) == 3 and all(q.is_enabled and isinstance(q.num_bits, tuple) for q in quantizers.values())


def unsupported_quantizers(root: torch.nn.Module) -> list[str]:
    """Enabled quantizers the export does not write itself (such as output quantizers): ModelOpt
    writes those while tracing, so their graph is traced on real tensors."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    # Softmax's range is fixed at 1 in ModelOpt's FP8 attention, which ignores its quantizer.
    written = (".weight_quantizer", ".input_quantizer", ".softmax_quantizer",
               *(f".{role}_bmm_quantizer" for role in ATTENTION_ROLES))
    return [name for name, module in root.named_modules()
            if isinstance(module, TensorQuantizer) and module.is_enabled and not name.endswith(written)]


def quantized_inputs(root: torch.nn.Module) -> list[QuantizedInput]:
    sites = []
    for name, module in root.named_modules():
        for role, quantizer in _quantizers(module, ("weight", "input")).items():
            if quantizer.is_enabled:
                sites.append(QuantizedInput(name, role, quantizer.amax.detach().float().cpu(),
                                            fp8=isinstance(quantizer.num_bits, tuple)))
    return sites


def quantized_attention(root: torch.nn.Module) -> list[QuantizedAttention]:
    return [QuantizedAttention(name, {role: getattr(module, f"{role}_bmm_quantizer").amax.detach().float().cpu()
                                      for role in ATTENTION_ROLES})
            for name, module in root.named_modules() if _fp8_attention(module)]


def _convolution_as_traced_op(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """The tracer records convolutions as ``_convolution``, which CPU and CUDA kernels call; the
    meta kernel computes the shape itself, so the trace would lose the layer. This one calls it."""
    return torch.ops.aten._convolution.default(input, weight, bias, stride, padding, dilation, transposed,
                                               output_padding, groups, False, False, True, True)


def _swap_tensors(root: torch.nn.Module, replace) -> list[tuple[dict, str, torch.Tensor]]:
    """Replaces every parameter and buffer of `root` by replace(tensor); returns the originals."""
    originals = []
    for module in root.modules():
        for store in (module._parameters, module._buffers):
            for key, tensor in store.items():
                if tensor is not None:
                    originals.append((store, key, tensor))
                    new = replace(tensor)
                    store[key] = torch.nn.Parameter(new, requires_grad=False) if isinstance(tensor, torch.nn.Parameter) else new
    return originals


@contextlib.contextmanager
def _traced_on_meta(spec: GraphSpec):
    """Makes `spec` traceable on the meta device: weights, buffers and inputs move to meta (real
    tensors stay untouched and come back afterwards), quantizers are switched off, and the
    convolution kernel is made visible to the tracer. Yields the trace arguments."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    enabled = [m for m in spec.module.modules() if isinstance(m, TensorQuantizer) and m.is_enabled]
    host = set(getattr(spec.module, "host_inputs", ()))
    args = tuple(a if name in host else a.to("meta") for name, a in zip(spec.input_names, spec.args))
    hooks = [m.register_forward_hook(lambda _m, _i, out: out.to("meta"))
             for m in (spec.module.host_modules() if host else [])]
    # ModelOpt's attention swaps in its FP8 attention function even with its quantizers off, and
    # that function takes ranges from the (meta) tensors: with every quantizer off for this trace,
    # the layer's own forward gives the same graph.
    functional = [m for m in spec.module.modules() if hasattr(m, "functionals_to_replace") and hasattr(m, "original_cls")]
    library = torch.library.Library("aten", "IMPL")
    originals = []
    try:
        for module in functional:
            module.forward = types.MethodType(module.original_cls.forward, module)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Oo]verrid")
            library.impl("convolution", _convolution_as_traced_op, "Meta")
        for quantizer in enabled:
            quantizer.disable()
        originals = _swap_tensors(spec.module, lambda t: t.to("meta"))
        yield args
    finally:
        for store, key, tensor in originals:
            store[key] = tensor
        for quantizer in enabled:
            quantizer.enable()
        for hook in hooks:
            hook.remove()
        for module in functional:
            module.__dict__.pop("forward", None)
        library._destroy()


def _module_path(node) -> str:
    """A traced node's name as a state-dict path: the exporter puts "/" between modules (and
    keeps the "." inside "down_blocks.1"), so both read as "."."""
    return node.name.lstrip("/").replace("/", ".")


def _drop_host_hops(model, spec: GraphSpec) -> None:
    """Removes the Cast the tracer records where a host module's output moves to meta: it casts
    to the type the tensor already has."""
    names = {module: name for name, module in spec.module.named_modules()}
    scopes = [f"{names[m]}." for m in spec.module.host_modules()]

    def in_host(node) -> bool:
        return _module_path(node).startswith(tuple(scopes))

    produced_in_host = {o for node in model.graph.node if in_host(node) for o in node.output}
    hops = {node.output[0]: node.input[0] for node in model.graph.node
            if node.op_type == "Cast" and not in_host(node) and node.input[0] in produced_in_host}
    kept = [node for node in model.graph.node if not (node.op_type == "Cast" and node.output[0] in hops)]
    for node in kept:
        node.input[:] = [hops.get(name, name) for name in node.input]
    del model.graph.node[:]
    model.graph.node.extend(kept)


def _numpy(tensor: torch.Tensor):
    return tensor.detach().cpu().contiguous().numpy()


def _attach_weights(model, tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """Turns the graph inputs that name weights into initializers holding `tensors`; inputs no
    node reads are dropped. Past 1 GB (half protobuf's limit, so the graph always fits) the
    weights go, one tensor at a time, into one external-data file beside the graph: an inline
    protobuf would hold them twice more, as messages and then serialized."""
    import onnx
    from onnx import numpy_helper

    used = {name for node in model.graph.node for name in node.input}
    weights = [i.name for i in model.graph.input if i.name in tensors]
    kept = [i for i in model.graph.input if i.name not in tensors]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    weights = [name for name in weights if name in used]
    external = sum(tensors[n].numel() * tensors[n].element_size() for n in weights) > PROTOBUF_LIMIT // 2
    if not external:
        model.graph.initializer.extend(numpy_helper.from_array(_numpy(tensors[n]), n) for n in weights)
        return
    with open(folder / EXTERNAL_DATA_FILE, "wb") as data:
        for name in weights:
            array = _numpy(tensors[name])
            initializer = onnx.TensorProto(name=name, dims=array.shape, data_location=onnx.TensorProto.EXTERNAL,
                                           data_type=onnx.helper.np_dtype_to_tensor_dtype(array.dtype))
            for key, value in (("location", EXTERNAL_DATA_FILE), ("offset", data.tell()), ("length", array.nbytes)):
                entry = initializer.external_data.add()
                entry.key, entry.value = key, str(value)
            data.write(memoryview(array.reshape(-1)).cast("B"))
            model.graph.initializer.append(initializer)


def _int8_constants(amax: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """Scale, zero point and axis as ModelOpt's INT8 export writes them: amax/127 in the graph's
    precision (1 where the range is 0), per output channel for weights."""
    if amax.numel() == 1:
        scale, axis = amax.reshape(()), None
    else:
        scale = amax.squeeze()
        axis = list(amax.shape).index(scale.shape[0])
    scale = scale.to(dtype) / 127
    scale = scale.masked_fill(scale == 0, 1.0)
    return scale, torch.zeros(scale.shape, dtype=torch.int8), axis


def _fp8_scale(amax: float, dtype: torch.dtype) -> torch.Tensor:
    """ModelOpt's FP8 scale, computed the way its export does: 1 / (448 / amax)."""
    return torch.tensor(1.0 / (448.0 / float(amax))).to(dtype)


class _GraphEdits:
    """Reroutes tensors of a graph through new nodes, keeping the node list in topological order."""

    def __init__(self, model):
        self.model = model
        self.nodes = list(model.graph.node)
        self.readers: dict[str, list] = collections.defaultdict(list)
        self.producer = {}
        for node in self.nodes:
            for name in node.input:
                self.readers[name].append(node)
            for name in node.output:
                self.producer[name] = node
        self.before: dict[int, list] = collections.defaultdict(list)
        self.after: dict[int, list] = collections.defaultdict(list)

    def only_reader(self, name: str, what: str):
        if len(self.readers[name]) != 1:
            raise RuntimeError(f"{what}: expected one reader of {name}, found {len(self.readers[name])}")
        return self.readers[name][0]

    def on_input(self, reader, slot: int, chain) -> None:
        """reader.input[slot] now comes through the nodes chain(source) returns."""
        nodes, output = chain(reader.input[slot])
        reader.input[slot] = output
        self.before[id(reader)].extend(nodes)

    def on_output(self, node, chain) -> None:
        """Whatever read node.output[0] now reads it through the nodes chain(source) returns."""
        original = node.output[0]
        node.output[0] = f"{original}_before_{chain.__name__}"
        nodes, output = chain(node.output[0])
        nodes[-1].output[0] = original
        self.after[id(node)].extend(nodes)

    def commit(self) -> None:
        del self.model.graph.node[:]
        self.model.graph.node.extend(new for node in self.nodes for new in
                                     (*self.before.get(id(node), ()), node, *self.after.get(id(node), ())))


def _qdq(model, prefix: str, scale: torch.Tensor, zero_point: torch.Tensor | None = None, axis: int | None = None):
    """A chain(source) making a Q/DQ pair named after the quantizer `prefix`; FP8 pairs (no zero
    point) are TensorRT's own FP8 ops, as ModelOpt writes them."""
    from onnx import helper, numpy_helper

    model.graph.initializer.append(numpy_helper.from_array(_numpy(scale), f"{prefix}.scale"))
    inputs = [f"{prefix}.scale"]
    if zero_point is not None:
        model.graph.initializer.append(numpy_helper.from_array(_numpy(zero_point), f"{prefix}.zero_point"))
        inputs.append(f"{prefix}.zero_point")
    ops, domain = (("QuantizeLinear", "DequantizeLinear"), "") if zero_point is not None else \
        (("TRT_FP8QuantizeLinear", "TRT_FP8DequantizeLinear"), "trt")
    attributes = {} if axis is None else {"axis": axis}
    path = "/" + prefix.replace(".", "/")

    def qdq(source: str):
        quantize = helper.make_node(ops[0], [source, *inputs], [f"{path}/{ops[0]}_output_0"],
                                    name=f"{path}/{ops[0]}", domain=domain, **attributes)
        dequantize = helper.make_node(ops[1], [quantize.output[0], *inputs], [f"{path}/{ops[1]}_output_0"],
                                      name=f"{path}/{ops[1]}", domain=domain, **attributes)
        return [quantize, dequantize], dequantize.output[0]

    return qdq


def _cast(to: int, after=None):
    """A chain(source) casting to ONNX type `to`, after the nodes of chain `after` if given."""
    from onnx import helper

    def cast(source: str):
        nodes, source = after(source) if after else ([], source)
        node = helper.make_node("Cast", [source], [f"{source}_cast"], name=f"{source}_cast", to=to)
        return [*nodes, node], node.output[0]

    return cast


def _insert_conv_linear_qdq(edits: _GraphEdits, site: QuantizedInput, dtype: torch.dtype) -> None:
    """Where ModelOpt's export puts them: on the weight before any Transpose, and on the layer's
    activation input (after SmoothQuant's Mul) for that layer only."""
    weight = f"{site.layer}.weight"
    weight_reader = edits.only_reader(weight, site.layer)
    layer = edits.only_reader(weight_reader.output[0], site.layer) if weight_reader.op_type == "Transpose" \
        else weight_reader
    if layer.op_type not in ("Conv", "MatMul", "Gemm"):
        raise RuntimeError(f"{site.layer}: its weight feeds a {layer.op_type}, not a Conv, MatMul or Gemm")
    prefix = f"{site.layer}.{site.role}_quantizer"
    constants = (_fp8_scale(site.amax, dtype),) if site.fp8 else _int8_constants(site.amax, dtype)
    if site.role == "weight":
        edits.on_input(weight_reader, list(weight_reader.input).index(weight), _qdq(edits.model, prefix, *constants))
    else:
        edits.on_input(layer, 0, _qdq(edits.model, prefix, *constants))


def _insert_fp8_attention(edits: _GraphEdits, site: QuantizedAttention, dtype: torch.dtype) -> None:
    """ModelOpt's FP8 attention: FP8 Q/DQ on the scaled q and k, on softmax (range 1) and on v,
    each cast to fp32 for its MatMul, whose outputs are cast back: TensorRT's FP8 MHA pattern."""
    import onnx

    if dtype != torch.float16:
        raise UserError("FP8 attention (quantize.quant_level=4) needs an fp16 UNet graph: set onnx.precision=fp16")
    softmax = [n for n in edits.nodes if n.op_type == "Softmax" and _module_path(n) == f"{site.layer}.Softmax"]
    if len(softmax) != 1:
        raise RuntimeError(f"{site.layer}: expected one attention Softmax, found {len(softmax)}")
    scores = edits.producer[softmax[0].input[0]]
    mix = edits.only_reader(softmax[0].output[0], site.layer)
    if (scores.op_type, mix.op_type) != ("MatMul", "MatMul"):
        raise RuntimeError(f"{site.layer}: its Softmax sits between {scores.op_type} and {mix.op_type}, not two MatMuls")
    to_float, to_half = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    quantizer = {role: f"{site.layer}.{role}_bmm_quantizer" for role in ATTENTION_ROLES}
    for slot, role in ((0, "q"), (1, "k")):
        edits.on_input(scores, slot, _cast(to_float, _qdq(edits.model, quantizer[role], _fp8_scale(site.amax[role], dtype))))
    edits.on_output(scores, _cast(to_half))
    edits.on_input(mix, 0, _cast(to_float, _qdq(edits.model, f"{site.layer}.softmax_quantizer", _fp8_scale(1.0, dtype))))
    edits.on_input(mix, 1, _cast(to_float, _qdq(edits.model, quantizer["v"], _fp8_scale(site.amax["v"], dtype))))
    edits.on_output(mix, _cast(to_half))


def _insert_qdq(model, module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Writes the Q/DQ of `module`'s enabled quantizers into its meta-traced graph."""
    from onnx import helper

    edits = _GraphEdits(model)
    sites = quantized_inputs(module)
    attention = quantized_attention(module)
    for site in sites:
        _insert_conv_linear_qdq(edits, site, dtype)
    for site in attention:
        _insert_fp8_attention(edits, site, dtype)
    edits.commit()
    if (attention or any(site.fp8 for site in sites)) and not any(o.domain == "trt" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("trt", 1))


def _trace(spec: GraphSpec, onnx_file: Path, opset: int) -> None:
    """Traces `spec` with its weights as graph inputs. Constant folding would fold transposed
    weights into new, unnamed inputs, so TensorRT and ONNX Runtime fold those when they load."""
    import torch.onnx

    tracing = _traced_on_meta(spec) if spec.on_meta else contextlib.nullcontext(spec.args)
    with tracing as args, torch.no_grad(), warnings.catch_warnings():
        # diffusers' shape asserts are constant under the trace; the graph stays dynamic.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        torch.onnx.export(spec.module, args, str(onnx_file), input_names=spec.input_names,
                          output_names=spec.output_names, dynamic_axes=spec.dynamic_axes, opset_version=opset,
                          dynamo=False, export_params=False, keep_initializers_as_inputs=True,
                          do_constant_folding=False)


def graph_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The graph's weights by initializer name: the traced module's state-dict keys."""
    return module.state_dict(keep_vars=True)


def export_graph(spec: GraphSpec, folder: Path, opset: int, meta: dict, dtype: torch.dtype) -> None:
    """Exports `spec` into `folder` atomically: everything is written beside it, then renamed."""
    import onnx

    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        start = time.perf_counter()
        graph = staging / "graph"  # made with the user's umask, unlike the private temp folder
        graph.mkdir()
        _trace(spec, graph / ONNX_FILE, opset)
        model = onnx.load(str(graph / ONNX_FILE))
        if spec.on_meta:
            _drop_host_hops(model, spec)
            _insert_qdq(model, spec.module, dtype)
        _attach_weights(model, graph_weights(spec.module), graph)
        onnx.save_model(model, str(graph / ONNX_FILE))
        del model
        onnx.checker.check_model(str(graph / ONNX_FILE))
        write_json(graph / META_FILE, {**meta, "seconds": round(time.perf_counter() - start, 2)})
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(graph, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def is_current(folder: Path, fingerprint: str) -> bool:
    meta = read_json(folder / META_FILE)
    return meta is not None and meta.get("fingerprint") == fingerprint and (folder / ONNX_FILE).is_file()
