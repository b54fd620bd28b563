"""Flux through every script on the tiny Flux (tiny CLIP and T5, a FluxTransformer2DModel with two
double- and two single-stream blocks, a 16-channel VAE): images equal diffusers' FluxPipeline's,
the DiT's quant levels, ONNX graphs equal to torch and to fake quantization, TensorRT-RTX builds,
evaluate.py, FP8 GEMMs, LoRA, and the refusals that keep families apart."""

from __future__ import annotations

import collections
import json

import numpy as np
import onnx
import pytest
import torch

from sdquant.export import onnx_graphs
from sdquant.load import load_pipeline, resolve_device
from sdquant.workflow.evaluate import run_evaluate
from sdquant.workflow.export_trt import run_export
from sdquant.workflow.infer_trt import run_infer
from sdquant.workflow.quantize import run_quantize

from conftest import (assert_fp8_kernels_draw_as_fake_quantization, assert_int8_graph_runs_as_fake_quantization,
                      compose_config, enabled_quantizers, quantize_each_recipe, refused_in_one_line, save_random_lora)

CPU = torch.device("cpu")
PROMPTS = ["a red fox in the snow", "a lighthouse at dusk"]
STEPS = 4
QUICK = ["model=tiny_flux", "device=cpu", "quantize.n_steps=4", "quantize.calib_size=4", "quantize.batch_size=2"]


def _pipe():
    return load_pipeline(compose_config("sd_xl_quantize", ["model=tiny_flux"]).model, CPU, torch.float32)


def _infer(out, *overrides):
    run_infer(compose_config("sd_xl_trt_inference", [
        "model=tiny_flux", "device=cpu", f"out_path={out}", f"sampling.prompts={json.dumps(PROMPTS)}",
        f"sampling.steps={STEPS}", "sampling.guidance_scale=3.5", *overrides]))
    return np.stack([np.asarray(_png(out / f"image_{i:03d}_00.png")) for i in range(len(PROMPTS))])


def _png(path):
    from PIL import Image

    return Image.open(path).convert("RGB")


@pytest.fixture(scope="module")
def checkpoints(model_cache, tmp_path_factory):
    return quantize_each_recipe(tmp_path_factory.mktemp("flux_quantized"), QUICK)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_torch_backend_draws_diffusers_flux_pipelines_image(tmp_path, model_cache, capsys, compiled):
    """Compiled, the transformer runs its own forms: q and k in rotary halves order, and every step's
    AdaLN modulations computed before the loop (a note would say where one did not apply)."""
    ours = _infer(tmp_path, "backend=torch", f"torch_backend.compile={str(compiled).lower()}")
    assert "note: the transformer" not in capsys.readouterr().out
    pipe = _pipe()
    reference = pipe(prompt=PROMPTS, num_inference_steps=STEPS, guidance_scale=3.5, height=64, width=64,
                     generator=[torch.Generator().manual_seed(42 + i) for i in range(len(PROMPTS))],
                     output_type="np").images
    assert ours.shape == (2, 64, 64, 3)
    assert np.abs(ours.astype(int) - np.round(reference * 255).astype(int)).max() <= 1


def _enabled(checkpoint) -> collections.Counter:
    """Enabled quantizers of a restored checkpoint, by the layer group they sit on (stream:layer)."""
    def group(owner: str) -> str:
        stream, _, rest = owner.partition(".")
        return f"{stream}:{rest.partition('.')[2]}" if stream.endswith("transformer_blocks") else f"top:{owner}"

    return enabled_quantizers("tiny_flux", checkpoint, group)


def test_levels_quantize_their_layer_groups_and_keep_embedders_and_modulation_high(checkpoints):
    level3 = _enabled(checkpoints["fp8_l3"])
    assert not [group for group in level3 if group.startswith("top:")], "embedders, norm_out, proj_out stay high"
    assert not [group for group in level3 if "norm" in group], "AdaLN modulation stays high"
    double = ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "attn.to_q", "attn.to_k",
              "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_out.0", "attn.to_add_out")
    single = ("proj_mlp", "proj_out", "attn.to_q", "attn.to_k", "attn.to_v")
    expected = {**{f"transformer_blocks:{g}": 4 for g in double}, **{f"single_transformer_blocks:{g}": 4 for g in single}}
    assert level3 == expected   # a weight and an input quantizer in each of the two blocks of each kind
    level4 = _enabled(checkpoints["fp8_l4"])
    attention_layers = 4  # two double- and two single-stream blocks
    assert all(level4[f"{role}_bmm_quantizer"] == attention_layers for role in "qkv")
    assert {g: n for g, n in level4.items() if ":" in g} == expected
    assert _enabled(checkpoints["int8_l3"]) == level3


def test_fp8_attention_ranges_are_what_sdpa_sees(checkpoints):
    sidecar = json.loads((checkpoints["fp8_l4"] / "checkpoint.json").read_text())
    ranges = {name: value for name, value in sidecar["activation_amax"].items() if "_bmm_quantizer" in name}
    assert len(ranges) == 12 and all(0 < value < 1e4 for value in ranges.values())


def test_onnx_graphs_run_as_torch_and_int8_as_fake_quantization(tmp_path, checkpoints):
    fp32 = tmp_path / "fp32"
    run_export(compose_config("sd_xl_export", ["model=tiny_flux", "device=cpu", f"infer.out_path={fp32}",
                                               "onnx.precision=fp32", "run_trt_export=false"]))
    assert {path.parent.name for path in (fp32 / "onnx").glob("*/model.onnx")} == {"clip", "t5", "transformer", "vae"}
    graph = onnx.load(str(onnx_graphs.onnx_path(fp32, "transformer")), load_external_data=False)
    assert [i.name for i in graph.graph.input] == ["hidden_states", "encoder_hidden_states", "pooled_projections",
                                                   "timestep", "img_ids", "txt_ids", "guidance"]
    ours = _infer(tmp_path / "ort", "backend=onnxruntime", f"+engines.transformer={fp32 / 'plan/transformer.plan'}",
                  f"engine_dir={fp32 / 'plan'}")
    torch_images = _infer(tmp_path / "torch", "backend=torch")
    assert np.abs(ours.astype(int) - torch_images.astype(int)).max() <= 1

    assert_int8_graph_runs_as_fake_quantization(tmp_path, "tiny_flux", checkpoints["int8_l3"], PROMPTS, STEPS)


@pytest.mark.parametrize("recipe", ["int8_l3", "fp8_l4"])
def test_quantized_transformers_build_with_tensorrt_rtx(tmp_path, checkpoints, recipe):
    out = tmp_path / "export"
    run_export(compose_config("sd_xl_export", [
        "model=tiny_flux", "device=cpu", f"infer.out_path={out}", f"quantized_unet={checkpoints[recipe]}",
        "infer.batch_size=1", "trt.max_batch_size=2"]))
    record = json.loads((out / "plan" / "engines.json").read_text())
    assert set(record) == {"clip", "t5", "transformer", "vae"}
    assert record["transformer"]["fp8"] == recipe.startswith("fp8")
    hidden = record["transformer"]["inputs"]["hidden_states"]["profile"]
    assert hidden == [[1, 16, 64], [1, 16, 64], [2, 16, 64]], "batch 1..2, 16 packed tokens of a 64x64 image"
    graph = onnx.load(str(onnx_graphs.onnx_path(out, "transformer")), load_external_data=False)
    kinds = collections.Counter(node.op_type for node in graph.graph.node)
    quantize = "TRT_FP8QuantizeLinear" if recipe.startswith("fp8") else "QuantizeLinear"
    # One Q/DQ per quantized weight and input (34 Linear layers), FP8 attention adds 4 per layer.
    assert kinds[quantize] == 68 + (16 if recipe == "fp8_l4" else 0)


def test_fp8_gemms_stay_within_half_a_db_of_fake_quantization(tmp_path, checkpoints):
    assert_fp8_kernels_draw_as_fake_quantization(_infer, tmp_path, checkpoints["fp8_l3"])


def test_lora_fuses_into_the_transformer_and_clip(tmp_path, model_cache):
    save_random_lora(tmp_path / "lora", _pipe(), 0, {"transformer": ["to_q", "to_k", "to_v", "to_out.0"],
                                                      "text_encoder": ["q_proj", "v_proj"]})
    adapter = f"model.loras=[{{path:'{tmp_path / 'lora'}',scale:1.0}}]"
    fused = load_pipeline(compose_config("sd_xl_quantize", ["model=tiny_flux", adapter]).model, CPU, torch.float32)
    base = _pipe()

    def first(module, suffix):
        return next(p for name, p in module.named_parameters() if name.endswith(suffix))

    changed = {name for name, (a, b) in {
        "transformer": (first(fused.transformer, "attn.to_q.weight"), first(base.transformer, "attn.to_q.weight")),
        "clip": (first(fused.text_encoder, "self_attn.q_proj.weight"),
                 first(base.text_encoder, "self_attn.q_proj.weight"))}.items()
        if not torch.equal(a, b)}
    assert changed == {"transformer", "clip"}
    assert not any("lora" in name for name, _ in fused.transformer.named_modules())


def test_families_are_kept_apart_in_one_line(tmp_path, checkpoints, capsys, model_cache):
    err = refused_in_one_line(run_quantize, compose_config("sd_xl_quantize", [
        *QUICK, "quantize.quant_level=1", f"out_dir={tmp_path / 'q'}"]), capsys)
    assert "quantize.quant_level=1 is not a level of flux models" in err
    sdxl_checkpoint = run_quantize(compose_config("sd_xl_quantize", [
        "model=tiny_sdxl", "device=cpu", "quantize.n_steps=2", "quantize.calib_size=2", "quantize.batch_size=2",
        "quantize.quant_level=1", f"out_dir={tmp_path / 'sdxl'}"]))
    capsys.readouterr()
    err = refused_in_one_line(run_infer, compose_config("sd_xl_trt_inference", [
        "model=tiny_flux", "device=cpu", "backend=torch", f"quantized_unet={sdxl_checkpoint}",
        f"out_path={tmp_path / 'images'}"]), capsys)
    assert "was made from a sdxl model, not from model=tiny_flux (flux)" in err
    err = refused_in_one_line(run_export, compose_config("sd_xl_export", [
        "model=tiny_sdxl", "device=cpu", f"quantized_unet={checkpoints['fp8_l3']}",
        f"infer.out_path={tmp_path / 'export'}"]), capsys)
    assert "was made from a flux model, not from model=tiny_sdxl (sdxl)" in err
    unet_graph = tmp_path / "unet.onnx"
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["out"])], "g",
                                   [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                                   [onnx.helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [1])])
    onnx.save(onnx.helper.make_model(graph), str(unet_graph))
    err = refused_in_one_line(run_evaluate, compose_config("sd_xl_evaluate", [
        "model=tiny_flux", "device=cpu", f"+variants.unet={unet_graph}", f"out_path={tmp_path / 'quality'}"]), capsys)
    assert "is not a transformer graph" in err
    err = refused_in_one_line(run_infer, compose_config("sd_xl_trt_inference", [
        "model=tiny_flux", "device=cpu", "backend=torch", "sampling.width=72", f"out_path={tmp_path / 'images'}"]),
        capsys)
    assert "sampling.width=72 must be a positive multiple of 16, the model's VAE scale factor times its 2x2" in err
    assert not any((tmp_path / name).exists() for name in ("q", "images", "export", "quality"))
