"""torch_backend.quantized=int8: an INT8 checkpoint's Linear layers as integer GEMMs and its
convolutions as integer convolution kernels (sdquant.runtime.kernels.int8; on the CPU their twins),
against ModelOpt's fake quantization."""

from __future__ import annotations

import pytest
import torch

from modelopt.torch.quantization.nn import QuantModule, TensorQuantizer

from sdquant.runtime import torch_backend
from sdquant.errors import UserError
from sdquant.families.sd.graphs import UNetGraph
from sdquant.runtime.kernels.int8 import Int8Conv2d, Int8Linear, int8_scales
from sdquant.quantize.quantizers import quantized_inputs
from sdquant.workflow.infer_trt import run_infer
from sdquant.families.sd import SDXL

from conftest import FAST_QUANTIZE, compose_config, restored_backbones
from test_torch_backend import _image, _psnr


def _quantize(tmp_path_factory, *overrides):
    from sdquant.workflow.quantize import run_quantize

    return run_quantize(compose_config("sd_xl_quantize", [
        "model=tiny_sdxl", f"out_dir={tmp_path_factory.mktemp('quantized')}", "device=cpu", *FAST_QUANTIZE,
        *overrides]))


@pytest.fixture(scope="module")
def int8_l3(tmp_path_factory, model_cache):
    # Level 3: every Linear layer, SmoothQuant's per-channel input scales on all of them.
    return _quantize(tmp_path_factory, "quantize.quant_level=3")


@pytest.fixture(scope="module")
def fp8_l3(tmp_path_factory, model_cache):
    return _quantize(tmp_path_factory, "quantize.format=fp8", "quantize.quant_level=3")


def _restored(checkpoint) -> torch.nn.Module:
    (unet,) = restored_backbones("tiny_sdxl", checkpoint).values()
    return unet.float().eval()


def _unet_inputs(unet) -> tuple[torch.Tensor, ...]:
    # An 8x8 latent: the deepest attention layers then see 16 rows or fewer, which the integer GEMM
    # pads to the 17 that CUDA's takes.
    generator = torch.Generator().manual_seed(0)
    config = unet.config
    return (torch.randn(1, 4, 8, 8, generator=generator), torch.tensor([700.0]),
            torch.randn(1, 77, config.cross_attention_dim, generator=generator),
            torch.randn(1, config.projection_class_embeddings_input_dim, generator=generator))


def _calls(unet, layers) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each of `layers`' input and output in one call of `unet`."""
    calls = {}

    def record(name):
        return lambda _module, args, output: calls.__setitem__(name, (args[0], output))

    handles = [unet.get_submodule(name).register_forward_hook(record(name)) for name in layers]
    with torch.no_grad():
        UNetGraph(unet)(*_unet_inputs(unet))
    for handle in handles:
        handle.remove()
    return calls


def test_int8_layers_round_as_modelopt_and_give_their_fake_quant_twins_output(int8_l3):
    fake = _restored(int8_l3)
    sites = {(site.layer, site.role): site for site in quantized_inputs(fake)}
    layers = sorted({layer for layer, _ in sites})
    with torch.no_grad():
        fake_weights = {layer: fake.get_submodule(layer).weight_quantizer(fake.get_submodule(layer).weight)
                        for layer in layers}
    smoothing = {layer: fake.get_submodule(layer).input_quantizer.pre_quant_scale for layer in layers}
    calls = _calls(fake, layers)
    real = _restored(int8_l3)
    assert torch_backend.convert_quantized(real, SDXL, str(int8_l3), "int8").layers == len(layers)
    assert not any(isinstance(module, QuantModule) for module in real.modules())
    linear = [layer for layer in layers if isinstance(real.get_submodule(layer), Int8Linear)]
    assert linear and all(smoothing[layer] is not None for layer in linear)
    # Every calibrated convolution of the tiny UNet has input channels in the kernel's strips.
    assert all(isinstance(real.get_submodule(layer), Int8Conv2d) for layer in layers if layer not in linear)
    with torch.no_grad():
        for layer in layers:
            module = real.get_submodule(layer)
            weight_scale, weight_divisor = int8_scales(sites[layer, "weight"].amax)
            if layer in linear:
                # The integer weights are ModelOpt's rounding of the smoothed weights, one scale per row.
                assert torch.equal(module.weight_int8.float() / weight_divisor, fake_weights[layer]), layer
                assert torch.equal(module.pre_quant_scale, smoothing[layer]), layer
            else:
                # The kernel's (out, rows, columns, in) filters, one divisor per output channel.
                filters = module.weight_int8.permute(0, 3, 1, 2).float()
                assert torch.equal(filters / module.weight_divisor.reshape(-1, 1, 1, 1), fake_weights[layer]), layer
            assert torch.equal(module.input_scale, int8_scales(sites[layer, "input"].amax)[0]), layer
            # On its fake-quant twin's own input: the same rounded values, so the same result but for
            # the float sum's order (the integer sum is exact).
            inputs, fake_output = calls[layer]
            assert (module(inputs) - fake_output).norm() / fake_output.norm() < 1e-5, layer


def test_the_int8_unet_gives_the_fake_quant_unets_output_and_compiles_as_one_graph(int8_l3):
    fake, real, unquantized = _restored(int8_l3), _restored(int8_l3), _restored(int8_l3)
    torch_backend.convert_quantized(real, SDXL, str(int8_l3), "int8")
    for quantizer in unquantized.modules():
        if isinstance(quantizer, TensorQuantizer):
            quantizer.disable()
    inputs = _unet_inputs(real)
    with torch.no_grad():
        expected = UNetGraph(fake)(*inputs)
        actual = UNetGraph(real)(*inputs)
        full_precision = UNetGraph(unquantized)(*inputs)
    off_fake, off_full = (float((output - expected).norm() / expected.norm()) for output in (actual, full_precision))
    print(f"UNet output relative to fake quantization's: {off_fake:.2e}; fake quantization's relative to the "
          f"unquantized UNet's: {off_full:.2e}")
    # A float ulp of summation order can move an activation lying on a rounding boundary to the
    # next INT8 step, and the next layers carry such flips on. How many there are depends on the
    # CPU's kernels (1.4-1.7e-2 on an AMD EPYC with AVX2, under 1e-2 on the CPUs before), so the
    # bound is set against what quantization itself moves the output (0.34): a wrong rounding,
    # scale or layer moves it as far as that.
    assert off_fake < 0.2 * off_full
    assert torch._dynamo.explain(UNetGraph(real))(*inputs).graph_break_count == 0


def test_int8_gemm_images_are_the_fake_quant_images_but_for_rounding_flips(int8_l3, tmp_path):
    settings = {"model": "tiny_sdxl", "steps": 6}
    fake = _image(tmp_path / "fake", f"quantized_unet={int8_l3}", **settings)
    real = _image(tmp_path / "real", f"quantized_unet={int8_l3}", "torch_backend.quantized=int8", **settings)
    print(f"INT8 GEMM images against fake quant images: {_psnr(fake, real):.2f} dB PSNR")
    # 52 dB on an AMD EPYC with two threads; the margin is for other CPUs' summation order.
    assert _psnr(fake, real) > 36


def test_an_int8_linear_compiles_to_what_it_computes_eagerly(int8_l3):
    real = _restored(int8_l3)
    torch_backend.convert_quantized(real, SDXL, str(int8_l3), "int8")
    layer = next(module for module in real.modules() if isinstance(module, Int8Linear))
    x = torch.randn(2, 40, layer.in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager, compiled = layer(x), torch.compile(layer)(x)
    assert (compiled - eager).norm() / eager.norm() < 1e-6


@pytest.mark.parametrize("checkpoint, quantized, held", [("int8_l3", "fp8", "int8"), ("fp8_l3", "int8", "fp8")])
def test_a_checkpoint_of_the_other_format_is_refused_naming_its_format(request, tmp_path, checkpoint, quantized,
                                                                          held):
    folder = request.getfixturevalue(checkpoint)
    message = f"quantized_unet={folder} is a format={held} checkpoint.*torch_backend.quantized={held}"
    with pytest.raises(UserError, match=message):
        run_infer(compose_config("sd_xl_trt_inference", ["model=tiny_sdxl", "backend=torch", "device=cpu",
                                                         f"out_path={tmp_path}", f"quantized_unet={folder}",
                                                         f"torch_backend.quantized={quantized}"]))
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
    # The conversion itself reads the format from the quantizers, for callers that skip infer_trt.py.
    with pytest.raises(UserError, match=message):
        torch_backend.convert_quantized(_restored(folder), SDXL, f"quantized_unet={folder}", quantized)


@pytest.mark.parametrize("overrides, message", [
    (["torch_backend.quantized=int8"], "torch_backend.quantized=int8 runs a quantize.py checkpoint: set "
                                       "quantized_backbone"),
    (["torch_backend.quantized=int4"], "torch_backend.quantized='int4' is unknown: choose fake, fp8, int8"),
])
def test_int8_settings_that_cannot_apply_are_refused(tmp_path, overrides, message):
    with pytest.raises(UserError, match=message):
        run_infer(compose_config("sd_xl_trt_inference", ["model=scenes_sdxl", "backend=torch", "device=cpu",
                                                         f"out_path={tmp_path}", *overrides]))
