"""Writes a quantized UNet's QuantizeLinear/DequantizeLinear pairs into its graph traced without them.

The export traces the UNet on the meta device with its ModelOpt quantizers off (sdquant.export.graphs);
this puts back, from the calibrated ranges, the Q/DQ pairs ModelOpt's own ONNX export would have
traced, with the same scales, types, names and places: on each quantized Conv and Linear layer's
weight (before any Transpose) and activation input, and around the two MatMuls of each attention
layer ModelOpt runs in FP8. FP8 pairs are TensorRT's own ops, as ModelOpt writes them.
"""

from __future__ import annotations

import torch

from ..errors import UserError
from ..quantize.quantizers import ATTENTION_ROLES, QuantizedAttention, QuantizedInput, quantized_attention, quantized_inputs

LINEAR_OPS = ("Conv", "MatMul", "Gemm")


def module_path(node) -> str:
    """A traced node's name as a state-dict path: the exporter puts "/" between modules (and
    keeps the "." inside "down_blocks.1"), so both read as "."."""
    return node.name.lstrip("/").replace("/", ".")


def int8_constants(amax: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, int | None]:
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


def fp8_scale(amax: float, dtype: torch.dtype) -> torch.Tensor:
    """ModelOpt's FP8 scale, computed the way its export does: 1 / (448 / amax)."""
    return torch.tensor(1.0 / (448.0 / float(amax))).to(dtype)


def _qdq(graph, source, prefix: str, scale: torch.Tensor, zero_point: torch.Tensor | None = None,
         axis: int | None = None):
    """`source` through a Q/DQ pair named after the quantizer `prefix`; returns the dequantized tensor.
    FP8 pairs (no zero point) are TensorRT's own FP8 ops."""
    import onnx_graphsurgeon as gs

    constants = [gs.Constant(f"{prefix}.scale", scale.numpy())]
    if zero_point is not None:
        constants.append(gs.Constant(f"{prefix}.zero_point", zero_point.numpy()))
    ops, domain = (("QuantizeLinear", "DequantizeLinear"), None) if zero_point is not None else \
        (("TRT_FP8QuantizeLinear", "TRT_FP8DequantizeLinear"), "trt")
    attrs = {} if axis is None else {"axis": axis}
    path = "/" + prefix.replace(".", "/")
    for op in ops:
        (source,) = graph.layer(op=op, name=f"{path}/{op}", inputs=[source, *constants],
                                outputs=[f"{path}/{op}_output_0"], attrs=attrs, domain=domain)
    return source


def _cast(graph, source, to: int):
    (cast,) = graph.layer(op="Cast", name=f"{source.name}_cast", inputs=[source], outputs=[f"{source.name}_cast"],
                          attrs={"to": to})
    return cast


def _cast_output(graph, node, to: int) -> None:
    """Whatever read node's output now reads it cast to ONNX type `to`."""
    import onnx_graphsurgeon as gs

    output = node.outputs[0]
    node.outputs[0] = gs.Variable(f"{output.name}_before_cast")
    graph.layer(op="Cast", name=f"{node.outputs[0].name}_cast", inputs=[node.outputs[0]], outputs=[output],
                attrs={"to": to})


def _only(nodes: list, what: str, tensor):
    if len(nodes) != 1:
        raise RuntimeError(f"{what}: expected one reader of {tensor.name}, found {len(nodes)}")
    return nodes[0]


def _weight_reader_and_layer(tensors: dict, layer: str):
    """The node reading a layer's weight (a Transpose for Linear layers), and the layer's own node."""
    weight = tensors[f"{layer}.weight"]
    reader = _only(weight.outputs, layer, weight)
    node = _only(reader.outputs[0].outputs, layer, reader.outputs[0]) if reader.op == "Transpose" else reader
    if node.op not in LINEAR_OPS:
        raise RuntimeError(f"{layer}: its weight feeds a {node.op}, not a Conv, MatMul or Gemm")
    return reader, node


def _conv_linear(graph, site: QuantizedInput, reader, layer, dtype: torch.dtype) -> None:
    """Where ModelOpt's export puts them: on the weight before any Transpose, and on the layer's
    activation input (after SmoothQuant's Mul) for that layer only."""
    prefix = f"{site.layer}.{site.role}_quantizer"
    constants = (fp8_scale(site.amax, dtype),) if site.fp8 else int8_constants(site.amax, dtype)
    node, slot = (reader, [t.name for t in reader.inputs].index(f"{site.layer}.weight")) if site.role == "weight" \
        else (layer, 0)
    node.inputs[slot] = _qdq(graph, node.inputs[slot], prefix, *constants)


def _fp8_attention(graph, site: QuantizedAttention, dtype: torch.dtype) -> None:
    """ModelOpt's FP8 attention: FP8 Q/DQ on the scaled q and k, on softmax (range 1) and on v,
    each cast to fp32 for its MatMul, whose outputs are cast back: TensorRT's FP8 MHA pattern."""
    import onnx

    if dtype != torch.float16:
        raise UserError("FP8 attention (quantize.quant_level=4) needs an fp16 UNet graph: set onnx.precision=fp16")
    softmax = [n for n in graph.nodes if n.op == "Softmax" and module_path(n) == f"{site.layer}.Softmax"]
    if len(softmax) != 1:
        raise RuntimeError(f"{site.layer}: expected one attention Softmax, found {len(softmax)}")
    scores = softmax[0].inputs[0].inputs[0]
    mix = _only(softmax[0].outputs[0].outputs, site.layer, softmax[0].outputs[0])
    if (scores.op, mix.op) != ("MatMul", "MatMul"):
        raise RuntimeError(f"{site.layer}: its Softmax sits between {scores.op} and {mix.op}, not two MatMuls")
    to_float, to_half = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    quantizer = {role: f"{site.layer}.{role}_bmm_quantizer" for role in ATTENTION_ROLES}
    inputs = [(scores, 0, quantizer["q"], site.amax["q"]), (scores, 1, quantizer["k"], site.amax["k"]),
              (mix, 0, f"{site.layer}.softmax_quantizer", 1.0), (mix, 1, quantizer["v"], site.amax["v"])]
    for node, slot, prefix, amax in inputs:
        node.inputs[slot] = _cast(graph, _qdq(graph, node.inputs[slot], prefix, fp8_scale(amax, dtype)), to_float)
    for node in (scores, mix):
        _cast_output(graph, node, to_half)


def insert_qdq(model, module: torch.nn.Module, dtype: torch.dtype):
    """`model`, the meta-traced graph of `module`, with the Q/DQ of its enabled quantizers written in."""
    import onnx_graphsurgeon as gs

    graph = gs.import_onnx(model)
    tensors = graph.tensors()
    sites = [(site, *_weight_reader_and_layer(tensors, site.layer)) for site in quantized_inputs(module)]
    for site, reader, layer in sites:
        _conv_linear(graph, site, reader, layer, dtype)
    for site in quantized_attention(module):
        _fp8_attention(graph, site, dtype)
    return gs.export_onnx(graph.toposort())
