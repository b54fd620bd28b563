"""ONNX export of the tiny models, checked by running the graphs in ONNX Runtime."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from modelopt.torch.quantization.nn import TensorQuantizer

from sdquant.quantize import checkpoint
from sdquant.export import onnx_graphs
from sdquant.families.encoders import ClipGraph, VaeDecoderGraph
from sdquant.families.sd.graphs import UNetGraph
from sdquant.families.sd import SDXL
from sdquant.families.sd.flow import sdxl_y
from sdquant.errors import UserError
from sdquant.workflow.export_trt import run_export
from sdquant.workflow.quantize import run_quantize

from conftest import compose_config

# Checked at another batch and latent size than the trace, and a longer context, to prove the
# dynamic axes work.
BATCH, LATENT, TOKENS = 3, 8, 80


def _export_cfg(out, *overrides, model="tiny_sdxl"):
    return compose_config("sd_xl_export", [f"model={model}", f"infer.out_path={out}", "device=cpu",
                                           "run_trt_export=false", *overrides])


def _session(path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / (np.abs(b).max() + 1e-12))


def _unet_feeds(unet, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal((BATCH, 4, LATENT, LATENT)),
             "timesteps": np.array([999.0, 500.0, 1.0]),
             "context": rng.standard_normal((BATCH, TOKENS, unet.config.cross_attention_dim))}
    if unet.config.addition_embed_type == "text_time":
        feeds["y"] = rng.standard_normal((BATCH, unet.config.projection_class_embeddings_input_dim))
    return {k: v.astype(np.float32 if k == "timesteps" else dtype) for k, v in feeds.items()}


def _torch_unet(unet, feeds):
    graph = UNetGraph(unet)
    with torch.no_grad():
        return graph(*[torch.from_numpy(feeds[k]) for k in ("x", "timesteps", "context", "y") if k in feeds]).numpy()


@pytest.fixture(scope="module")
def fp32_export(tmp_path_factory, model_cache):
    out = tmp_path_factory.mktemp("fp32_export")
    cfg = _export_cfg(out, "onnx.precision=fp32")
    return cfg, run_export(cfg)


def test_sdxl_graphs_have_nemo_names(fp32_export):
    cfg, files = fp32_export
    assert [f.parent.name for f in files] == ["clip1", "clip2", "vae", "unet_xl"]
    unet = onnx.load(str(onnx_graphs.onnx_path(cfg.infer.out_path, "unet_xl")), load_external_data=False)
    assert [i.name for i in unet.graph.input] == ["x", "timesteps", "context", "y"]
    assert [o.name for o in unet.graph.output] == ["out"]
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in unet.graph.input}
    assert dims == {"x": ["B", 4, "H", "W"], "timesteps": ["B"], "context": ["B", "S", 64], "y": ["B", 80]}


def test_fp32_graphs_match_pytorch(fp32_export, tiny_pipeline):
    cfg, _ = fp32_export
    pipe = tiny_pipeline()
    ids = np.random.default_rng(1).integers(0, 500, (BATCH, 77)).astype(np.int32)
    with torch.no_grad():
        clip1 = ClipGraph(pipe.text_encoder, penultimate=True)(torch.from_numpy(ids))
        clip2 = ClipGraph(pipe.text_encoder_2, penultimate=True, pooled=True)(torch.from_numpy(ids))
        latent = torch.randn(BATCH, 4, LATENT, LATENT)
        image = VaeDecoderGraph(pipe.vae)(latent)
    out = cfg.infer.out_path
    assert _rel_err(_session(onnx_graphs.onnx_path(out, "clip1")).run(None, {"input_ids": ids})[0], clip1) < 1e-5
    hidden, pooled = _session(onnx_graphs.onnx_path(out, "clip2")).run(None, {"input_ids": ids})
    assert _rel_err(hidden, clip2[0]) < 1e-5 and _rel_err(pooled, clip2[1]) < 1e-5
    assert _rel_err(_session(onnx_graphs.onnx_path(out, "vae")).run(None, {"latent": latent.numpy()})[0], image) < 1e-5
    feeds = _unet_feeds(pipe.unet)
    unet_out = _session(onnx_graphs.onnx_path(out, "unet_xl")).run(None, feeds)[0]
    assert _rel_err(unet_out, _torch_unet(pipe.unet, feeds)) < 1e-5


def test_unet_graph_runs_at_latent_sizes_no_multiple_of_its_upsampling(fp32_export, tiny_pipeline):
    cfg, _ = fp32_export
    unet = tiny_pipeline().unet
    feeds = _unet_feeds(unet)
    feeds["x"] = np.random.default_rng(2).standard_normal((BATCH, 4, 7, 9)).astype(np.float32)
    graph = _session(onnx_graphs.onnx_path(cfg.infer.out_path, "unet_xl")).run(None, feeds)[0]
    assert graph.shape == (BATCH, 4, 7, 9)
    assert _rel_err(graph, _torch_unet(unet, feeds)) < 1e-5


def test_y_is_pooled_embedding_and_fourier_time_ids(tiny_pipeline):
    """The graph's y route equals the diffusers UNet fed text_embeds and time_ids."""
    unet = tiny_pipeline().unet
    pooled = torch.randn(2, 32)
    time_ids = torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]] * 2)
    args = (torch.randn(2, 4, 8, 8), torch.tensor([10.0, 10.0]), torch.randn(2, 77, 64))
    with torch.no_grad():
        reference = unet(*args, added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}).sample
        via_y = UNetGraph(unet)(*args, sdxl_y(unet.add_time_proj, pooled, 64, 64))
    assert torch.allclose(reference, via_y)


def test_fp16_graphs_are_fp16_and_run(tmp_path, model_cache, tiny_pipeline):
    cfg = _export_cfg(tmp_path)
    run_export(cfg)
    pipe = tiny_pipeline()
    unet_file = onnx_graphs.onnx_path(tmp_path, "unet_xl")
    initializers = collections.Counter(i.data_type for i in onnx.load(str(unet_file)).graph.initializer)
    assert initializers[onnx.TensorProto.FLOAT16] > 0 and initializers[onnx.TensorProto.FLOAT] == 0
    feeds = _unet_feeds(pipe.unet, np.float16)
    result = _session(unet_file).run(None, feeds)[0]
    assert result.dtype == np.float16
    # fp16 keeps about three significant digits; the tiny UNet's output is O(1).
    assert _rel_err(result, _torch_unet(pipe.unet, {k: v.astype(np.float32) for k, v in feeds.items()})) < 2e-2
    ids = np.zeros((BATCH, 77), np.int32)
    assert _session(onnx_graphs.onnx_path(tmp_path, "clip2")).run(None, {"input_ids": ids})[0].dtype == np.float16
    vae = _session(onnx_graphs.onnx_path(tmp_path, "vae"))
    assert vae.get_inputs()[0].type == "tensor(float)", "the VAE stays fp32 by default"


def test_sd15_graphs(tmp_path, model_cache):
    files = run_export(_export_cfg(tmp_path, "onnx.precision=fp32", model="tiny_sd15"))
    assert [f.parent.name for f in files] == ["clip1", "vae", "unet"]
    unet = onnx.load(str(files[-1]))
    assert [i.name for i in unet.graph.input] == ["x", "timesteps", "context"]


def test_existing_files_are_reused_unless_forced(tmp_path, model_cache, capsys):
    cfg = _export_cfg(tmp_path, "onnx.precision=fp32")
    run_export(cfg)
    unet_file = onnx_graphs.onnx_path(tmp_path, "unet_xl")
    mtime = unet_file.stat().st_mtime_ns
    capsys.readouterr()
    run_export(cfg)
    assert capsys.readouterr().out.count("  reused  ") == 4
    assert unet_file.stat().st_mtime_ns == mtime
    run_export(_export_cfg(tmp_path, "onnx.precision=fp32", "force=true"))
    assert unet_file.stat().st_mtime_ns != mtime
    assert not [p for p in (tmp_path / "onnx").iterdir() if p.name.startswith(".")], "no staging folder left"


def _quantized_checkpoint(quantize_cfg, *overrides, model="tiny_sdxl"):
    return run_quantize(quantize_cfg(*overrides, model=model))


def test_int8_unet_matches_fake_quant(quantize_cfg, tiny_pipeline, tmp_path):
    # The trained scene UNet: through random weights, the few values that round to the other side
    # of a boundary (ModelOpt rounds x * (127 / amax), ONNX x / (amax / 127)) grew to ~10%
    # depending on the thread count; a trained network does not amplify them.
    model = "scenes_sdxl"
    folder = _quantized_checkpoint(quantize_cfg, "quantize.quant_level=3", model=model)
    run_export(_export_cfg(tmp_path, "onnx.precision=fp32", f"quantized_unet={folder}", model=model))
    reference = tiny_pipeline(model).unet
    quantized = tiny_pipeline(model).unet
    checkpoint.restore(quantized, folder, "unet")
    feeds = _unet_feeds(reference)
    onnx_out = _session(onnx_graphs.onnx_path(tmp_path, "unet_xl")).run(None, feeds)[0]
    fake_quant = _torch_unet(quantized, feeds)
    full_precision = _torch_unet(reference, feeds)
    # The graph must agree with the fake-quant model to within a few percent and be no further
    # from the unquantized model than the fake-quant model itself is.
    quantization_error = _rel_err(fake_quant, full_precision)
    assert quantization_error > 1e-3, "8-bit must differ from fp32"
    assert _rel_err(onnx_out, fake_quant) < 0.05
    assert _rel_err(onnx_out, full_precision) < 1.5 * quantization_error + 1e-3


def _enabled_quantizers(quantized_unet) -> int:
    return sum(1 for m in quantized_unet.modules() if isinstance(m, TensorQuantizer) and m.is_enabled)


EXCLUDED_NODES = ("/conv_in/", "/conv_out/", "conv_shortcut", "time_embedding", "time_emb_proj", "add_embedding")


@pytest.mark.parametrize("level", [1, 2, 2.5, 3])
def test_int8_graph_holds_one_qdq_pair_per_quantizer(quantize_cfg, tiny_pipeline, tmp_path, level):
    folder = _quantized_checkpoint(quantize_cfg, f"quantize.quant_level={level}", "quantize.n_steps=2")
    run_export(_export_cfg(tmp_path, f"quantized_unet={folder}"))
    graph = onnx.load(str(onnx_graphs.onnx_path(tmp_path, "unet_xl"))).graph
    ops = collections.Counter(node.op_type for node in graph.node)
    unet = tiny_pipeline().unet
    checkpoint.restore(unet, folder, "unet")
    assert ops["QuantizeLinear"] == ops["DequantizeLinear"] == _enabled_quantizers(unet)
    dequantized = {o for node in graph.node if node.op_type == "DequantizeLinear" for o in node.output}
    for node in graph.node:
        if node.op_type in ("Conv", "Gemm", "MatMul") and any(part in node.name for part in EXCLUDED_NODES):
            assert not set(node.input) & dequantized, f"{node.name} must stay in high precision"
    readers = collections.defaultdict(list)
    for node in graph.node:
        for name in node.input:
            readers[name].append(node)
    for name in dequantized:
        (reader,) = readers[name]
        if reader.op_type == "Transpose":  # a Linear weight, quantized before it is transposed
            (reader,) = readers[reader.output[0]]
        assert reader.op_type in ("Conv", "MatMul", "Gemm"), f"{name} feeds a {reader.op_type}"
    scales = [i for i in graph.initializer if i.name.endswith("_quantizer.scale")]
    assert len(scales) == ops["QuantizeLinear"]
    assert all(i.data_type == onnx.TensorProto.FLOAT16 for i in scales), "fp16 Q/DQ scales"


def test_export_leaves_the_quantized_unet_as_it_was(quantize_cfg, tiny_pipeline, tmp_path):
    # The UNet is traced on the meta device with its quantizers off: afterwards the model must
    # hold its own weights and compute exactly what it did before.
    folder = _quantized_checkpoint(quantize_cfg, "quantize.quant_level=3")
    pipe = tiny_pipeline()
    checkpoint.restore(pipe.unet, folder, "unet")
    feeds = _unet_feeds(pipe.unet)
    before, enabled = _torch_unet(pipe.unet, feeds), _enabled_quantizers(pipe.unet)
    spec = SDXL.graph_specs(pipe, 2, None, LATENT, torch.float32, torch.float32)[-1]
    assert spec.on_meta
    onnx_graphs.export_graph(spec, tmp_path / "unet_xl", 19, {}, torch.float32)
    assert not any(t.is_meta for t in (*pipe.unet.parameters(), *pipe.unet.buffers()))
    assert _enabled_quantizers(pipe.unet) == enabled > 0
    assert np.array_equal(_torch_unet(pipe.unet, feeds), before)


def _typed_fp8_qdq(model):
    """A copy of `model` that says the output type of each of TensorRT's FP8 Q/DQ ops (FP8, or its
    scale's type), which ONNX's shape inference cannot: without it no type is inferred past them,
    in a graph that carries none of its own (the meta trace's)."""
    typed = onnx.ModelProto()
    typed.CopyFrom(model)
    graph = typed.graph
    scale_types = {i.name: i.data_type for i in graph.initializer}
    scale_types.update({n.output[0]: n.attribute[0].t.data_type for n in graph.node if n.op_type == "Constant"})
    known = {v.name for v in graph.value_info}
    for node in graph.node:
        if node.op_type in ("TRT_FP8QuantizeLinear", "TRT_FP8DequantizeLinear") and node.output[0] not in known:
            elem_type = (onnx.TensorProto.FLOAT8E4M3FN if node.op_type == "TRT_FP8QuantizeLinear"
                         else scale_types[node.input[1]])
            graph.value_info.append(onnx.helper.make_tensor_value_info(node.output[0], elem_type, None))
    return typed


def _op_counts(model) -> collections.Counter:
    """Operators that compute something. Left out: constants (ModelOpt writes its zero points as
    Constant + Cast nodes, the export as int8 initializers), Casts to the type their input
    already has (ModelOpt's INT8 export leaves one on some inputs, both FP8 ones one after an
    attention left in 16 bits) and nodes nothing reads."""
    graph = onnx.shape_inference.infer_shapes(_typed_fp8_qdq(model)).graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.value_info, *graph.input, *graph.output)}
    constants = {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    read = {name for n in graph.node for name in n.input} | {o.name for o in graph.output}

    def computes(node) -> bool:
        if node.op_type == "Cast" and (node.input[0] in constants or types.get(node.input[0]) == node.attribute[0].i):
            return False
        return node.op_type != "Constant" and any(o in read for o in node.output)

    return collections.Counter(n.op_type for n in graph.node if computes(n))


@pytest.mark.parametrize("fmt,level,dtype", [("int8", 3, torch.float32), ("fp8", 4, torch.float16)])
def test_qdq_written_by_the_export_match_modelopts_own(quantize_cfg, tiny_pipeline, tmp_path, fmt, level, dtype):
    # The same checkpoint traced on real tensors, where ModelOpt's quantizers write their own
    # Q/DQ, must give the same operators (and, where ONNX Runtime runs it, the same numbers) as
    # the meta trace plus insertion.
    folder = _quantized_checkpoint(quantize_cfg, f"quantize.format={fmt}", f"quantize.quant_level={level}",
                                   "quantize.n_steps=2")
    pipe = tiny_pipeline()
    checkpoint.restore(pipe.unet, folder, "unet")
    onnx_graphs.prepare_quantizers_for_export(pipe.unet, dtype)
    spec = SDXL.graph_specs(pipe, 2, None, LATENT, dtype, torch.float32)[-1]
    assert spec.on_meta
    onnx_graphs.export_graph(spec, tmp_path / "inserted", 19, {}, dtype)
    onnx_graphs.export_graph(dataclasses.replace(spec, on_meta=False), tmp_path / "modelopt", 19, {}, dtype)
    exported = {name: onnx.load(str(tmp_path / name / onnx_graphs.ONNX_FILE)) for name in ("inserted", "modelopt")}
    ops = {name: _op_counts(model) for name, model in exported.items()}
    assert ops["inserted"]["QuantizeLinear" if fmt == "int8" else "TRT_FP8QuantizeLinear"] > 0
    assert ops["inserted"] == ops["modelopt"]
    if fmt == "int8":
        feeds = _unet_feeds(pipe.unet)
        inserted, modelopt = (_session(tmp_path / name / onnx_graphs.ONNX_FILE).run(None, feeds)[0] for name in exported)
        assert _rel_err(inserted, modelopt) < 1e-5


def test_fp8_graph_uses_tensorrt_fp8_qdq(quantize_cfg, tmp_path):
    folder = _quantized_checkpoint(quantize_cfg, "quantize.format=fp8", "quantize.quant_level=4", "quantize.n_steps=2")
    run_export(_export_cfg(tmp_path, f"quantized_unet={folder}"))
    unet_file = onnx_graphs.onnx_path(tmp_path, "unet_xl")
    ops = collections.Counter(node.op_type for node in onnx.load(str(unet_file)).graph.node)
    assert ops["TRT_FP8QuantizeLinear"] > 0 and ops["TRT_FP8DequantizeLinear"] > 0
    # ModelOpt writes FP8 Q/DQ as TensorRT's own ops, which only TensorRT runs; the engine
    # build checks this graph instead.
    with pytest.raises(Exception, match="TRT_FP8"):
        _session(unet_file)


def test_checkpoint_of_other_family_is_refused(quantize_cfg, tmp_path, model_cache):
    folder = _quantized_checkpoint(quantize_cfg, "quantize.quant_level=1", model="tiny_sd15")
    with pytest.raises(UserError, match="made from a sd15 model"):
        run_export(_export_cfg(tmp_path, f"quantized_unet={folder}"))
    assert not (tmp_path / "onnx").exists()
