"""The VAE decodes in a dtype whose range holds: SDXL's own VAE overflows fp16 (its config says
force_upcast), so a half-precision pipeline decodes it in bf16; model.vae_source swaps in another
VAE (an fp16-safe one) and model.vae_dtype names the dtype outright."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sdquant.errors import UserError
from sdquant.families.encoders import VaeDecoderGraph
from sdquant.graphs.networks import VAE
from sdquant.load import decoder_dtype, load_pipeline, model_configs
from sdquant.runtime.stages import TorchStage
from sdquant.workflow.infer_trt import run_infer

from conftest import compose_config

CPU = torch.device("cpu")
# Makes the decoder's first activations about this much larger: past fp16's 65504, well inside bf16's
# range. Its GroupNorms then take the scale out again, so the images stay images.
OVERFLOW = 3e5


def _model(*overrides):
    return compose_config("sd_xl_quantize", ["model=tiny_sdxl", *overrides]).model


def _overflowing(vae):
    """`vae` with its decoder's input convolution scaled so that its fp16 activations overflow."""
    with torch.no_grad():
        vae.decoder.conv_in.weight.mul_(OVERFLOW)
        vae.decoder.conv_in.bias.mul_(OVERFLOW)
    return vae


def _decoded(vae, dtype, latents) -> torch.Tensor:
    """The images the torch stages' VAE stage decodes from `latents` with `vae` in `dtype`."""
    return TorchStage(VaeDecoderGraph(vae.to(dtype)), VAE, dtype)(latent=latents)["images"].float()


def test_auto_decodes_in_bf16_where_the_vae_says_fp16_overflows(model_cache):
    model = _model()
    assert model_configs(model)["vae_config"]["force_upcast"]  # as SDXL-base's own VAE says
    pipe = load_pipeline(model, CPU, torch.float16)
    assert pipe.unet.dtype == torch.float16 and pipe.vae.dtype == torch.bfloat16
    assert decoder_dtype(model, {"force_upcast": False}, torch.float16) == torch.float16
    assert decoder_dtype(model, {"force_upcast": True}, torch.bfloat16) == torch.bfloat16
    assert decoder_dtype(_model("model.vae_dtype=fp32"), {"force_upcast": False}, torch.float16) == torch.float32

    vae = _overflowing(pipe.vae.float())
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    reference = _decoded(vae, torch.float32, latents)
    assert torch.isfinite(reference).all() and reference.abs().max() > 0.1
    # The test VAE does overflow fp16, so the dtype choice is what keeps its images finite.
    assert not torch.isfinite(_decoded(vae, torch.float16, latents)).all()
    in_bf16 = _decoded(vae, torch.bfloat16, latents)
    assert torch.isfinite(in_bf16).all()
    # In [-1, 1]: bf16 keeps 8 bits of mantissa, a few 255ths of the fp32 image at most.
    assert (in_bf16 - reference).abs().mean() < 0.01 and (in_bf16 - reference).abs().max() < 0.08


@pytest.fixture(scope="module")
def overflowing_vae(tmp_path_factory, model_cache):
    folder = tmp_path_factory.mktemp("vae") / "overflowing"
    _overflowing(load_pipeline(_model(), CPU, torch.float32).vae).save_pretrained(folder)
    return folder


def _latency(tmp_path, name: str, *overrides) -> dict:
    out = tmp_path / name
    run_infer(compose_config("sd_xl_trt_inference", [
        "model=tiny_sdxl", "backend=torch", "device=cpu", f"out_path={out}", "sampling.prompts=['a red fox']",
        "sampling.steps=2", "sampling.width=64", "sampling.height=64", "num_warmup_runs=0", *overrides]))
    return json.loads((out / "latency.json").read_text())


def test_infer_decodes_with_another_vae_and_counts_what_overflows(overflowing_vae, tmp_path):
    source = f"model.vae_source={overflowing_vae}"
    overflowed = _latency(tmp_path, "fp16", source, "model.vae_dtype=fp16")
    assert overflowed["nonfinite_values"] > 0
    assert _latency(tmp_path, "bf16", source, "model.vae_dtype=bf16")["nonfinite_values"] == 0
    assert overflowed["settings"]["model"]["vae_source"] == str(overflowing_vae)


def test_infer_images_with_another_vae_are_its_own(overflowing_vae, tmp_path):
    from PIL import Image

    _latency(tmp_path, "own")
    _latency(tmp_path, "other", f"model.vae_source={overflowing_vae}")
    own, other = (np.asarray(Image.open(tmp_path / name / "image_000_00.png")).astype(float)
                  for name in ("own", "other"))
    # Same latents, another decoder: the scaled VAE draws another picture.
    assert np.abs(own - other).mean() > 5


def test_a_vae_of_other_latents_or_no_vae_is_refused(model_cache, tmp_path):
    flux_vae = tmp_path / "flux_vae"
    load_pipeline(compose_config("sd_xl_quantize", ["model=tiny_flux"]).model, CPU, torch.float32).vae.save_pretrained(
        flux_vae)
    with pytest.raises(UserError, match=r"model.vae_source=.*16 latent channels where model=tiny_sdxl's VAE has 4"):
        model_configs(_model(f"model.vae_source={flux_vae}"))
    with pytest.raises(UserError, match=r"model.vae_source=.*no VAE there"):
        load_pipeline(_model(f"model.vae_source={tmp_path / 'missing'}"), CPU, torch.float32)
    with pytest.raises(UserError, match=r"model.vae_dtype='fp8' is unknown"):
        load_pipeline(_model("model.vae_dtype=fp8"), CPU, torch.float32)
