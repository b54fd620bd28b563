"""SD3.5 through every script on the tiny SD3 (tiny CLIP-L, CLIP-G and T5, an SD3Transformer2DModel
with three blocks: one with SD3.5-medium's second attention, one plain, the last with no text
output; RMS-normed q/k; a 16-channel VAE): images equal diffusers' StableDiffusion3Pipeline's, the
MMDiT's quant levels, ONNX graphs equal to torch at two sizes and to fake quantization, TensorRT-RTX
builds, evaluate.py, FP8 GEMMs and attention, LoRA, and the refusals that keep families apart."""

from __future__ import annotations

import collections
import json

import numpy as np
import onnx
import pytest
import torch

from sdquant.export.onnx_graphs import onnx_path
from sdquant.load import load_pipeline
from sdquant.workflow.export_trt import run_export
from sdquant.workflow.infer_trt import run_infer
from sdquant.workflow.quantize import run_quantize

from conftest import (assert_fp8_kernels_draw_as_fake_quantization, assert_int8_graph_runs_as_fake_quantization,
                      compose_config, enabled_quantizers, quantize_each_recipe, refused_in_one_line, restored_backbones,
                      save_random_lora)

CPU = torch.device("cpu")
# The second prompt is longer than the tiny T5's 256 tokens (one a character): T5 cuts it as
# diffusers does, and says what it drops.
LONG_PROMPT = "a lighthouse at dusk, " * 11 + "and a ship far out at sea"
PROMPTS = ["a red fox in the snow", LONG_PROMPT]
STEPS = 4
QUICK = ["model=tiny_sd3", "device=cpu", "quantize.n_steps=4", "quantize.calib_size=4", "quantize.batch_size=2"]
GRAPHS = {"clip_l", "clip_g", "t5", "transformer", "vae"}


def _pipe(*overrides):
    return load_pipeline(compose_config("sd_xl_quantize", ["model=tiny_sd3", *overrides]).model, CPU, torch.float32)


def _infer(out, *overrides, prompts=PROMPTS, guidance=4.5, per_prompt=1):
    run_infer(compose_config("sd_xl_trt_inference", [
        "model=tiny_sd3", "device=cpu", f"out_path={out}", f"sampling.prompts={json.dumps(prompts)}",
        f"sampling.steps={STEPS}", f"sampling.guidance_scale={guidance}", "sampling.negative_prompt=blurry",
        f"sampling.num_images_per_prompt={per_prompt}", *overrides]))
    return np.stack([np.asarray(_png(out / f"image_{i:03d}_{k:02d}.png"))
                     for i in range(len(prompts)) for k in range(per_prompt)])


def _png(path):
    from PIL import Image

    return Image.open(path).convert("RGB")


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    from skimage.metrics import peak_signal_noise_ratio

    return peak_signal_noise_ratio(a, b, data_range=255)


@pytest.fixture(scope="module")
def checkpoints(model_cache, tmp_path_factory):
    return quantize_each_recipe(tmp_path_factory.mktemp("sd3_quantized"), QUICK)


@pytest.mark.parametrize("guidance, per_prompt, compiled", [(4.5, 1, False), (0.0, 2, False), (4.5, 1, True)],
                         ids=["guided", "turbo_unguided", "guided_compiled"])
def test_torch_backend_draws_diffusers_sd3_pipelines_image(tmp_path, model_cache, capsys, guidance, per_prompt,
                                                           compiled):
    """Compiled, the transformer takes every step's AdaLN modulations computed before the loop, for
    the negative and the positive prompt (a note would say where that did not apply)."""
    ours = _infer(tmp_path, "backend=torch", f"torch_backend.compile={str(compiled).lower()}", guidance=guidance,
                  per_prompt=per_prompt)
    said = capsys.readouterr()
    assert "note: the transformer" not in said.out
    cut = [line for line in said.err.splitlines() if "longer than T5's 256 tokens" in line]
    assert len(cut) == 1 and "out at sea'" in cut[0], "T5 cuts the long prompt once, naming what it drops"
    images = len(PROMPTS) * per_prompt
    reference = _pipe()(prompt=PROMPTS, negative_prompt="blurry", num_inference_steps=STEPS, guidance_scale=guidance,
                        num_images_per_prompt=per_prompt, height=64, width=64, output_type="np",
                        generator=[torch.Generator().manual_seed(42 + i) for i in range(images)]).images
    assert ours.shape == (images, 64, 64, 3)
    reference = np.round(reference * 255).astype(np.uint8)
    assert np.abs(ours.astype(int) - reference.astype(int)).max() <= 1
    assert min(_psnr(r, o) for r, o in zip(reference, ours)) >= 40


def _enabled(checkpoint) -> collections.Counter:
    """Enabled quantizers of a restored checkpoint, by the layer group they sit on (summed over blocks)."""
    def group(owner: str) -> str:
        stack, _, rest = owner.partition(".")
        return rest.partition(".")[2] if stack == "transformer_blocks" else f"top:{owner}"

    return enabled_quantizers("tiny_sd3", checkpoint, group)


def test_levels_quantize_their_layer_groups_and_keep_embedders_and_modulation_high(checkpoints):
    level3 = _enabled(checkpoints["fp8_l3"])
    assert not [group for group in level3 if group.startswith("top:")], "embedders, norm_out, proj_out stay high"
    assert not [group for group in level3 if "norm" in group], "AdaLN modulation stays high"
    # Two quantizers (weight, input) per layer; three blocks, of which the last has no text output
    # and only the first SD3.5-medium's attn2.
    every_block = ("ff.net.0.proj", "ff.net.2", "attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj",
                   "attn.add_k_proj", "attn.add_v_proj", "attn.to_out.0")
    text_output = ("ff_context.net.0.proj", "ff_context.net.2", "attn.to_add_out")
    dual = ("attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")
    expected = {**{g: 6 for g in every_block}, **{g: 4 for g in text_output}, **{g: 2 for g in dual}}
    assert level3 == expected
    assert _enabled(checkpoints["int8_l3"]) == level3
    level4 = _enabled(checkpoints["fp8_l4"])
    attention_layers = 4  # three joint attentions and one attn2
    assert all(level4[f"{role}_bmm_quantizer"] == attention_layers for role in "qkv")
    assert {g: n for g, n in level4.items() if "bmm" not in g and "softmax" not in g} == expected


def test_onnx_graphs_run_as_torch_at_the_traced_size_and_another(tmp_path, model_cache):
    fp32 = tmp_path / "fp32"
    run_export(compose_config("sd_xl_export", ["model=tiny_sd3", "device=cpu", f"infer.out_path={fp32}",
                                               "onnx.precision=fp32", "run_trt_export=false"]))
    assert {path.parent.name for path in (fp32 / "onnx").glob("*/model.onnx")} == GRAPHS
    dims = {}
    for graph in GRAPHS:
        model = onnx.load(str(onnx_path(fp32, graph)), load_external_data=False).graph
        dims.update({f"{graph}.{i.name}": [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
                     for i in model.input if "." not in i.name})
    assert dims == {"clip_l.input_ids": ["B", 77], "clip_g.input_ids": ["B", 77], "t5.input_ids": ["B", "T"],
                    "vae.latent": ["B", 16, "H", "W"], "transformer.hidden_states": ["B", 16, "H", "W"],
                    "transformer.encoder_hidden_states": ["B", "J", 96], "transformer.pooled_projections": ["B", 80],
                    "transformer.timestep": ["B"]}
    # Traced at 128x128 pixels (onnx.trace_latent_size=16); run at the native 64x64 and at 96x64.
    for height in (64, 96):
        size = f"sampling.height={height}"
        graphs = _infer(tmp_path / f"ort{height}", "backend=onnxruntime", f"engine_dir={fp32 / 'plan'}", size)
        modules = _infer(tmp_path / f"torch{height}", "backend=torch", size)
        assert graphs.shape[1] == height and np.abs(graphs.astype(int) - modules.astype(int)).max() <= 1


def test_int8_graph_runs_as_fake_quantization_in_evaluate(tmp_path, checkpoints):
    assert_int8_graph_runs_as_fake_quantization(tmp_path, "tiny_sd3", checkpoints["int8_l3"], PROMPTS, STEPS,
                                                "sampling.guidance_scale=4.5")


@pytest.mark.parametrize("recipe", ["int8_l3", "fp8_l4"])
def test_quantized_transformers_build_with_tensorrt_rtx(tmp_path, checkpoints, recipe):
    out = tmp_path / "export"
    run_export(compose_config("sd_xl_export", [
        "model=tiny_sd3", "device=cpu", f"infer.out_path={out}", f"quantized_unet={checkpoints[recipe]}",
        "infer.batch_size=1", "trt.max_batch_size=2", "trt.backend=tensorrt_rtx"]))
    record = json.loads((out / "plan" / "engines.json").read_text())
    assert set(record) == GRAPHS and record["transformer"]["flavour"] == "tensorrt_rtx"
    assert record["transformer"]["fp8"] == recipe.startswith("fp8")
    inputs = record["transformer"]["inputs"]
    # Guided: the negative and the positive prompt in one batch, 1..2 images; 77 CLIP + 256 T5 tokens.
    assert inputs["hidden_states"]["profile"] == [[1, 16, 8, 8], [2, 16, 8, 8], [4, 16, 8, 8]]
    assert inputs["encoder_hidden_states"]["profile"] == [[1, 333, 96], [2, 333, 96], [4, 333, 96]]
    assert record["t5"]["inputs"]["input_ids"]["profile"] == [[1, 256], [2, 256], [4, 256]]
    graph = onnx.load(str(onnx_path(out, "transformer")), load_external_data=False)
    kinds = collections.Counter(node.op_type for node in graph.graph.node)
    quantize = "TRT_FP8QuantizeLinear" if recipe.startswith("fp8") else "QuantizeLinear"
    # One Q/DQ per quantized weight and input (37 Linear layers); FP8 attention adds 4 per layer.
    assert kinds[quantize] == 74 + (16 if recipe == "fp8_l4" else 0)


def _transformer(checkpoint, kernels: bool, level: float):
    """The checkpoint's transformer, in fake quantization or converted to the FP8 kernels (their CPU twins)."""
    from sdquant.families.sd3 import SD3
    from sdquant.runtime import torch_backend

    (transformer,) = restored_backbones("tiny_sd3", checkpoint).values()
    transformer.to(torch.float32)
    conversion = torch_backend.convert_quantized(transformer, SD3, "quantized_unet", "fp8", "auto", level) \
        if kernels else None
    return transformer, conversion


@pytest.mark.parametrize("recipe, level, attention, tolerance", [("fp8_l3", 3.0, 0, 1e-5), ("fp8_l4", 4.0, 4, 1e-2)])
def test_fp8_kernels_compute_what_fake_quantization_does(checkpoints, recipe, level, attention, tolerance):
    fake, _ = _transformer(checkpoints[recipe], False, level)
    kernels, conversion = _transformer(checkpoints[recipe], True, level)
    # Every quantized Linear runs as an FP8 GEMM; at level 4 every attention (three joint, one attn2)
    # runs SD3's FP8 processor.
    assert (conversion.layers, conversion.attention) == (37, attention)
    torch.manual_seed(1)
    inputs = {"hidden_states": torch.randn(2, 16, 8, 12), "encoder_hidden_states": torch.randn(2, 333, 96),
              "pooled_projections": torch.randn(2, 80), "timestep": torch.tensor([700.0, 700.0])}
    with torch.no_grad():
        expected, got = (module(**inputs, return_dict=False)[0] for module in (fake, kernels))
    assert (got - expected).norm() / expected.norm() < tolerance


def test_fp8_attention_images_stay_within_half_a_db_of_fake_quantization(tmp_path, checkpoints):
    assert_fp8_kernels_draw_as_fake_quantization(_infer, tmp_path, checkpoints["fp8_l4"])


def test_lora_fuses_into_the_transformer_and_both_clips(tmp_path, model_cache):
    save_random_lora(tmp_path / "lora", _pipe(), 0, {"transformer": ["to_q", "to_k", "to_v", "to_out.0"],
                                                      "text_encoder": ["q_proj", "v_proj"],
                                                      "text_encoder_2": ["q_proj", "v_proj"]})
    fused = _pipe(f"model.loras=[{{path:'{tmp_path / 'lora'}',scale:1.0}}]")
    base = _pipe()

    def first(module, suffix):
        return next(p for name, p in module.named_parameters() if name.endswith(suffix))

    changed = {component for component, suffix in {"transformer": "attn.to_q.weight",
                                                   "text_encoder": "self_attn.q_proj.weight",
                                                   "text_encoder_2": "self_attn.q_proj.weight"}.items()
               if not torch.equal(first(getattr(fused, component), suffix), first(getattr(base, component), suffix))}
    assert changed == {"transformer", "text_encoder", "text_encoder_2"}
    assert not any("lora" in name for name, _ in fused.transformer.named_modules())
    torch.manual_seed(1)
    inputs = {"hidden_states": torch.randn(1, 16, 8, 8), "encoder_hidden_states": torch.randn(1, 333, 96),
              "pooled_projections": torch.randn(1, 80), "timestep": torch.tensor([500.0])}
    with torch.no_grad():
        outputs = [pipe.transformer(**inputs, return_dict=False)[0] for pipe in (fused, base)]
    assert (outputs[0] - outputs[1]).abs().max() > 1e-3


def test_families_are_kept_apart_in_one_line(tmp_path, checkpoints, capsys, model_cache):
    err = refused_in_one_line(run_quantize, compose_config("sd_xl_quantize", [
        *QUICK, "quantize.quant_level=1", f"out_dir={tmp_path / 'q'}"]), capsys)
    assert "quantize.quant_level=1 is not a level of sd3 models: choose one of 2, 2.5, 3, 4" in err
    flux_checkpoint = run_quantize(compose_config("sd_xl_quantize", [
        "model=tiny_flux", "device=cpu", "quantize.n_steps=2", "quantize.calib_size=2", "quantize.batch_size=2",
        "quantize.format=fp8", "quantize.quant_level=3", f"out_dir={tmp_path / 'flux'}"]))
    capsys.readouterr()
    err = refused_in_one_line(run_infer, compose_config("sd_xl_trt_inference", [
        "model=tiny_sd3", "device=cpu", "backend=torch", f"quantized_unet={flux_checkpoint}",
        f"out_path={tmp_path / 'images'}"]), capsys)
    assert err.startswith("error: quantized_unet=") and "was made from a flux model, not from model=tiny_sd3 (sd3)" in err
    err = refused_in_one_line(run_export, compose_config("sd_xl_export", [
        "model=tiny_flux", "device=cpu", f"quantized_backbone={checkpoints['fp8_l3']}",
        f"infer.out_path={tmp_path / 'export'}"]), capsys)
    assert err.startswith("error: quantized_backbone=") and "was made from a sd3 model, not from model=tiny_flux (flux)" in err
    err = refused_in_one_line(run_infer, compose_config("sd_xl_trt_inference", [
        "model=tiny_sd3", "device=cpu", "backend=torch", "sampling.width=72", f"out_path={tmp_path / 'images'}"]),
        capsys)
    assert "sampling.width=72 must be a positive multiple of 16, the model's VAE scale factor times its 2x2" in err
    # diffusers 0.42's SD3Transformer2DModel has no cache hooks (CacheMixin): refused before any work.
    err = refused_in_one_line(run_infer, compose_config("sd_xl_trt_inference", [
        "model=tiny_sd3", "device=cpu", "backend=torch", "sampling.cache.method=first_block",
        f"out_path={tmp_path / 'images'}"]), capsys)
    assert "sampling.cache.method=first_block: model=tiny_sd3's transformer takes none" in err
    err = refused_in_one_line(run_infer, compose_config("sd_xl_trt_inference", [
        "model=tiny_sd3", "device=cpu", "backend=torch", f"sampling.prompts={json.dumps(PROMPTS)}",
        "sampling.long_prompts=error", f"out_path={tmp_path / 'images'}"]), capsys)
    assert "sampling.long_prompts=error: prompt 'a lighthouse at dusk" in err and "T5's" in err and "out at sea" in err
    assert not any((tmp_path / name).exists() for name in ("q", "images", "export"))


def test_fused_projections_compute_what_the_unfused_transformer_does(model_cache):
    # The compiled torch backend fuses q, k and v of an unquantized transformer; diffusers' own fused
    # processor skips the q/k RMS norms (1.2% off here) and fails on the image-only attn2 of the
    # tiny model's first block (SD3.5-medium's).
    from sdquant.families import family_of
    from sdquant.families.sd3.graphs import TRANSFORMER

    transformer = _pipe().transformer.eval()
    assert any(getattr(block, "attn2", None) is not None for block in transformer.transformer_blocks)
    torch.manual_seed(2)
    inputs = {"hidden_states": torch.randn(2, 16, 8, 8), "encoder_hidden_states": torch.randn(2, 333, 96),
              "pooled_projections": torch.randn(2, 80), "timestep": torch.tensor([999.0, 999.0])}
    with torch.no_grad():
        unfused = transformer(**inputs, return_dict=False)[0]
        family_of("sd3").fuse_projections(transformer)
        assert all(hasattr(attn, "to_qkv") for name, attn in transformer.named_modules() if name.endswith("attn2"))
        fused = transformer(**inputs, return_dict=False)[0]
    assert (fused - unfused).norm() / unfused.norm() < 1e-5
    # The stage hands the timestep over in fp32 whatever the transformer's precision, as the pipeline.
    assert TRANSFORMER.kept_precision == ("timestep",)
