"""Export stage: the pipeline's networks as ONNX graphs with their family's names.

``<out_path>/onnx/<name>/model.onnx`` for each network its family describes (names, inputs,
dynamic axes); the family says what module and sample inputs each graph is traced from
(ModelFamily.graph_specs).

Every graph is traced with its weights as graph inputs, which are then written once, straight
from the model's tensors, as initializers. The backbone is traced on the meta device: the trace
then computes nothing and copies no weight, which is what lets a full-size SDXL UNet export in
well under a minute and a few GB on a CPU host. Its ModelOpt quantizers are switched off for that
trace and their QuantizeLinear/DequantizeLinear pairs are written into the graph afterwards from
their calibrated ranges (sdquant.export.insert_qdq), as ModelOpt's own ONNX export gives them.
"""

from __future__ import annotations

import contextlib
import time
import types
import warnings
from pathlib import Path

import torch

from ..artifacts import atomic_folder, read_json, write_json
from ..errors import UserError
from .insert_qdq import insert_qdq, module_path
from ..graphs.networks import Network
from ..graphs.specs import GraphSpec

ONNX_FILE = "model.onnx"
EXTERNAL_DATA_FILE = "model.onnx.data"
META_FILE = "export.json"
PROTOBUF_LIMIT = 2 * 1024**3


def onnx_path(out_path: str | Path, name: str) -> Path:
    """Where graph `name` of an export into `out_path` lies: <out_path>/onnx/<name>/model.onnx."""
    return Path(out_path).expanduser() / "onnx" / name / ONNX_FILE


def graph_files(onnx_file: Path) -> list[Path]:
    """The graph and, for one past protobuf's limit, its external-data file."""
    data = onnx_file.parent / EXTERNAL_DATA_FILE
    return [onnx_file, data] if data.is_file() else [onnx_file]


def prepare_quantizers_for_export(unet, dtype: torch.dtype) -> None:
    """Q/DQ scales in the graph's own precision, so the graph is fp16 + 8-bit throughout."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    high_precision = "Half" if dtype == torch.float16 else "Float"
    for module in unet.modules():
        if isinstance(module, TensorQuantizer):
            module.trt_high_precision_dtype = high_precision


def _convolution_as_traced_op(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """The tracer records convolutions as ``_convolution``, which CPU and CUDA kernels call; the
    meta kernel computes the shape itself, so the trace would lose the layer. This one calls it."""
    return torch.ops.aten._convolution.default(input, weight, bias, stride, padding, dilation, transposed,
                                               output_padding, groups, False, False, True, True)


def _swap_tensors(root: torch.nn.Module, replace, kept: tuple = ()) -> list[tuple[dict, str, torch.Tensor]]:
    """Replaces every parameter and buffer of `root` but those of the modules `kept` (and theirs) by
    replace(tensor); returns the originals."""
    originals = []
    skipped = {id(module) for each in kept for module in each.modules()}
    for module in root.modules():
        if id(module) in skipped:
            continue
        for store in (module._parameters, module._buffers):
            for key, tensor in store.items():
                if tensor is not None:
                    originals.append((store, key, tensor))
                    new = replace(tensor)
                    store[key] = torch.nn.Parameter(new, requires_grad=False) if isinstance(tensor, torch.nn.Parameter) else new
    return originals


def _to_meta(output):
    """A host module's output (a tensor, or a tuple of them as a rotary embedding gives) on meta."""
    return tuple(_to_meta(each) for each in output) if isinstance(output, tuple) else output.to("meta")


@contextlib.contextmanager
def _traced_on_meta(spec: GraphSpec):
    """Makes `spec` traceable on the meta device: weights, buffers and inputs move to meta (real
    tensors stay untouched and come back afterwards), quantizers are switched off, and the
    convolution kernel is made visible to the tracer. Yields the trace arguments."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    enabled = [m for m in spec.module.modules() if isinstance(m, TensorQuantizer) and m.is_enabled]
    host = set(getattr(spec.module, "host_inputs", ()))
    args = tuple(a if name in host else a.to("meta") for name, a in zip(spec.input_names, spec.args))
    hooks = [m.register_forward_hook(lambda _m, _i, out: _to_meta(out))
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
            # torch 2.11 refuses to override its own Python meta kernel unless told to.
            library.impl("convolution", _convolution_as_traced_op, "Meta", allow_override=True)
        for quantizer in enabled:
            quantizer.disable()
        # A host module computes on the host with its own tensors (a rotary table's buffers).
        originals = _swap_tensors(spec.module, lambda t: t.to("meta"), tuple(spec.module.host_modules()) if host else ())
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


def _drop_host_hops(model, spec: GraphSpec) -> None:
    """Removes the Cast the tracer records where a host module's output moves to meta: it casts
    to the type the tensor already has."""
    names = {module: name for name, module in spec.module.named_modules()}
    scopes = [f"{names[m]}." for m in spec.module.host_modules()]

    def in_host(node) -> bool:
        return module_path(node).startswith(tuple(scopes))

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


def _trace(spec: GraphSpec, onnx_file: Path, opset: int) -> None:
    """Traces `spec` with its weights as graph inputs. Constant folding would fold transposed
    weights into new, unnamed inputs, so TensorRT and ONNX Runtime fold those when they load."""
    import torch.onnx

    tracing = _traced_on_meta(spec) if spec.on_meta else contextlib.nullcontext(spec.args)
    # A graph module may say what its model needs changed to trace with dynamic axes.
    traceable = getattr(spec.module, "traceable", contextlib.nullcontext)
    with tracing as args, _upsampling_to_skip_sizes(spec.module), _rms_norm_decomposed(spec.module), traceable(), \
            torch.no_grad(), warnings.catch_warnings():
        # diffusers' shape asserts are constant under the trace; the graph stays dynamic.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        torch.onnx.export(spec.module, args, str(onnx_file), input_names=spec.input_names,
                          output_names=spec.output_names,
                          dynamic_axes=None if spec.network.fixed else spec.network.dynamic_axes,
                          opset_version=opset, dynamo=False, export_params=False, keep_initializers_as_inputs=True,
                          do_constant_folding=False)


@contextlib.contextmanager
def _upsampling_to_skip_sizes(root: torch.nn.Module):
    """diffusers' UNet upsamples by 2 where the latent is a multiple of 2**num_upsamplers, else to the
    size of the matching skip connection: a graph traced on the first path runs only at such sizes
    (a 72x56 image's 9x7 latent would fail), one traced on the second runs at any. With that factor
    out of reach while tracing, the trace takes the second path, which at a multiple upsamples to
    exactly twice the size: the same nearest-neighbour result."""
    unets = [module for module in root.modules() if hasattr(module, "num_upsamplers")]
    upsamplers = [unet.num_upsamplers for unet in unets]
    for unet in unets:
        unet.num_upsamplers = 30  # 2**30: more than any latent side, and an int64 under the trace
    try:
        yield
    finally:
        for unet, count in zip(unets, upsamplers):
            unet.num_upsamplers = count


def _rms_norm_forward(self, x):
    """torch.nn.RMSNorm in ops every opset has: the exporter knows no aten::rms_norm before
    opset 23 (Flux's q/k norms use it)."""
    eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return normed * self.weight if self.weight is not None else normed


@contextlib.contextmanager
def _rms_norm_decomposed(root: torch.nn.Module):
    norms = [module for module in root.modules() if isinstance(module, torch.nn.RMSNorm)]
    for norm in norms:
        norm.forward = types.MethodType(_rms_norm_forward, norm)
    try:
        yield
    finally:
        for norm in norms:
            del norm.forward


def graph_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The graph's weights by initializer name: the traced module's state-dict keys."""
    return module.state_dict(keep_vars=True)


def export_graph(spec: GraphSpec, folder: Path, opset: int, meta: dict, dtype: torch.dtype) -> None:
    """Exports `spec` into `folder` atomically: everything is written beside it, then renamed."""
    import onnx

    with atomic_folder(folder) as graph:
        start = time.perf_counter()
        _trace(spec, graph / ONNX_FILE, opset)
        model = onnx.load(str(graph / ONNX_FILE))
        if spec.on_meta:
            _drop_host_hops(model, spec)
            model = insert_qdq(model, spec.module, dtype)
        _attach_weights(model, graph_weights(spec.module), graph)
        onnx.save_model(model, str(graph / ONNX_FILE))
        del model
        onnx.checker.check_model(str(graph / ONNX_FILE))
        write_json(graph / META_FILE, {**meta, "seconds": round(time.perf_counter() - start, 2)})


def is_current(folder: Path, fingerprint: str) -> bool:
    meta = read_json(folder / META_FILE)
    return meta is not None and meta.get("fingerprint") == fingerprint and (folder / ONNX_FILE).is_file()


def check_graph_file(path: Path, key: str, network: Network | None = None, given: Path | None = None) -> None:
    """Refuses, before any work, an ONNX file that is truncated or corrupt, whose external weights
    are missing or cut short, or (with `network`) that is another network's graph. Reads the graph
    without its weights: cheap even for a full-size UNet. `given`: what config `key` holds when the
    file was found from it (an engine's graph beside its plan), so the message names both."""
    import onnx
    from google.protobuf.message import DecodeError

    again = "export it again with export_trt.py"
    named = f"{key}={path}" if given is None else f"{key}={given}: its ONNX graph {path}"
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, OSError, ValueError) as error:
        raise UserError(f"{named} is not a readable ONNX graph ({str(error).splitlines()[0]}): {again}") from None
    for tensor in model.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        data_file = path.parent / info.get("location", "")
        needed = int(info.get("offset", 0)) + int(info.get("length", 0))
        if not data_file.is_file() or data_file.stat().st_size < needed:
            raise UserError(f"{named}: its weights file {data_file} is missing or shorter than the graph "
                            f"says ({needed} bytes): {again}")
    inputs = {value.name for value in model.graph.input} - {t.name for t in model.graph.initializer}
    if network is not None and not set(network.required_inputs) <= inputs:
        raise UserError(f"{named} is not a {network.name} graph (its inputs are {', '.join(sorted(inputs))}, "
                        f"a {network.name} takes {', '.join(network.input_names)})")
