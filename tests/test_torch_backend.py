"""backend=torch at speed: torch.compile, and a quantize.py checkpoint's FP8 layers as FP8 GEMMs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from modelopt.torch.quantization.nn import QuantModule

from sdquant import torch_backend
from sdquant.errors import UserError
from sdquant.families.stable_diffusion import UNetGraph
from sdquant.load import empty_backbone
from sdquant.quantizers import quantized_inputs
from sdquant.workflow.common import restore_quantized_unet
from sdquant.workflow.infer_trt import run_infer
from sdquant.workflow.quantize import run_quantize

from conftest import compose_config

SCENE_PROMPTS = ["a large purple triangle at the bottom, white background",
                 "a small blue circle on the left, pink background"]


def _quantize(tmp_path_factory, *overrides):
    return run_quantize(compose_config("sd_xl_quantize", [
        "model=scenes_sdxl", f"out_dir={tmp_path_factory.mktemp('quantized')}", "device=cpu",
        "quantize.n_steps=4", "quantize.calib_size=4", "quantize.batch_size=2", *overrides]))


@pytest.fixture(scope="module")
def fp8_l3(tmp_path_factory):
    return _quantize(tmp_path_factory, "quantize.format=fp8", "quantize.quant_level=3")


def _restored(checkpoint):
    model = compose_config("sd_xl_quantize", ["model=scenes_sdxl"]).model
    unet = empty_backbone(model)
    restore_quantized_unet(model, "quantized_unet", str(checkpoint), unet)
    return model, unet.float().eval()


def _unet_inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 4, 16, 16, generator=generator), torch.tensor([700.0, 700.0]),
            torch.randn(2, 77, 192, generator=generator), torch.randn(2, 176, generator=generator))


def test_fp8_layers_take_every_scale_from_the_checkpoint_and_match_fake_quantization(fp8_l3):
    _, fake = _restored(fp8_l3)
    sites = {(s.layer, s.role): s for s in quantized_inputs(fake)}
    with torch.no_grad():
        expected = UNetGraph(fake, sdxl=True)(*_unet_inputs())
        fake_weights = {layer: fake.get_submodule(layer).weight_quantizer(fake.get_submodule(layer).weight)
                        for layer, role in sites if role == "weight"}
    _, real = _restored(fp8_l3)
    converted = torch_backend.convert_to_fp8(real, str(fp8_l3))
    assert converted == len(fake_weights) > 100
    for (layer, role), site in sites.items():
        module = real.get_submodule(layer)
        if role == "input":
            assert float(module.input_scale) == pytest.approx(float(site.amax) / 448, rel=1e-6)
        elif isinstance(module, torch_backend.Fp8Linear):
            assert float(module.weight_scale) == pytest.approx(float(site.amax) / 448, rel=1e-6)
            assert torch.equal(module.weight_fp8.float() * module.weight_scale, fake_weights[layer])
        else:
            assert torch.equal(module.weight, fake_weights[layer])
    assert not any(isinstance(m, QuantModule) for m in real.modules())
    with torch.no_grad():
        actual = UNetGraph(real, sdxl=True)(*_unet_inputs())
    assert (actual - expected).norm() / expected.norm() < 1e-4
    # ModelOpt's module classes are gone, so torch.compile sees the whole UNet as one graph.
    assert torch._dynamo.explain(UNetGraph(real, sdxl=True))(*_unet_inputs()).graph_break_count == 0


def _image(tmp_path, *overrides, model="scenes_sdxl", size=64, steps=20):
    run_infer(compose_config("sd_xl_trt_inference", [
        f"model={model}", "backend=torch", "device=cpu", f"out_path={tmp_path}", f"sampling.prompts={SCENE_PROMPTS}",
        f"sampling.steps={steps}", f"sampling.width={size}", f"sampling.height={size}", "num_warmup_runs=0",
        "sampling.batch_size=2", *overrides]))
    return np.stack([np.asarray(Image.open(tmp_path / f"image_000_{i:02d}.png")) / 255.0 for i in range(2)])


def _psnr(a, b) -> float:
    from skimage.metrics import peak_signal_noise_ratio

    return float(peak_signal_noise_ratio(a, b, data_range=1.0))


def test_fp8_gemm_images_stay_within_half_a_db_of_fake_quant_images(fp8_l3, tmp_path):
    fp16 = _image(tmp_path / "fp16")
    fake = _image(tmp_path / "fake", f"quantized_unet={fp8_l3}")
    real = _image(tmp_path / "real", f"quantized_unet={fp8_l3}", "torch_backend.quantized=fp8")
    assert abs(_psnr(fp16, real) - _psnr(fp16, fake)) < 0.5
    # 39.2 dB with two CPU threads and above 40 with one: the GEMMs' summation order differs.
    assert _psnr(fake, real) > 36


def test_compiled_pipeline_draws_the_eager_image(tmp_path, model_cache):
    eager = _image(tmp_path / "eager", model="tiny_sdxl", steps=2)
    compiled = _image(tmp_path / "compiled", "torch_backend.compile=true", model="tiny_sdxl", steps=2)
    assert _psnr(eager, compiled) > 40


@pytest.mark.parametrize("overrides, message", [
    (["quantize.quant_level=3"], "INT8 layers"),
    (["quantize.format=fp8", "quantize.quant_level=4"], "FP8 attention"),
])
def test_checkpoints_fp8_gemms_cannot_run_are_refused_naming_fake_quant(tmp_path_factory, overrides, message):
    checkpoint = _quantize(tmp_path_factory, *overrides)
    _, unet = _restored(checkpoint)
    with pytest.raises(UserError, match=f"{message}.*torch_backend.quantized=fake"):
        torch_backend.convert_to_fp8(unet, str(checkpoint))


@pytest.mark.parametrize("overrides, key", [
    (["backend=onnxruntime", "torch_backend.compile=true"], "backend=onnxruntime"),
    (["torch_backend.quantized=fp8"], "quantized_unet"),
    (["torch_backend.compile_mode=fastest"], "torch_backend.compile_mode"),
])
def test_torch_backend_settings_that_cannot_apply_are_refused(tmp_path, overrides, key):
    with pytest.raises(UserError, match=key):
        run_infer(compose_config("sd_xl_trt_inference", ["model=scenes_sdxl", "backend=torch", "device=cpu",
                                                         f"out_path={tmp_path}", *overrides]))
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
