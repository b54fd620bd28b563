"""backend=torch at speed: torch.compile, and a quantize.py checkpoint's FP8 layers as FP8 GEMMs and
convolutions (INT8 GEMMs and convolutions: test_int8_gemm.py; the convolution kernels: test_conv8.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from modelopt.torch.quantization.nn import QuantModule

from sdquant.runtime import torch_backend
from sdquant.errors import UserError
from sdquant.families.sd.graphs import UNetGraph
from sdquant.runtime.kernels.fp8_layers import Fp8Conv2d, Fp8Linear
from sdquant.quantize.quantizers import quantized_inputs
from sdquant.quantize.shared_ranges import projection_groups
from sdquant.workflow.infer_trt import run_infer
from sdquant.workflow.quantize import run_quantize
from sdquant.families.sd import SDXL

from conftest import compose_config, restored_backbones

SCENE_PROMPTS = ["a large purple triangle at the bottom, white background",
                 "a small blue circle on the left, pink background"]


def _quantize(tmp_path_factory, *overrides, model="scenes_sdxl"):
    return run_quantize(compose_config("sd_xl_quantize", [
        f"model={model}", f"out_dir={tmp_path_factory.mktemp('quantized')}", "device=cpu",
        "quantize.n_steps=4", "quantize.calib_size=4", "quantize.batch_size=2", *overrides]))


@pytest.fixture(scope="module")
def fp8_l3(tmp_path_factory):
    return _quantize(tmp_path_factory, "quantize.format=fp8", "quantize.quant_level=3")


@pytest.fixture(scope="module")
def tiny_fp8_l3(tmp_path_factory, model_cache):
    return _quantize(tmp_path_factory, "quantize.format=fp8", "quantize.quant_level=3", model="tiny_sdxl")


def _restored(checkpoint):
    model = compose_config("sd_xl_quantize", ["model=scenes_sdxl"]).model
    (unet,) = restored_backbones("scenes_sdxl", checkpoint).values()
    return model, unet.float().eval()


def _unet_inputs(seed: int = 0):
    # One sample at an 8x8 latent: on CPUs whose oneDNN has no FP8 kernel but its reference one
    # (a Xeon with AMX: 2 s for a 1024x128x512 GEMM), a 2x16x16 UNet call takes 20 s.
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 4, 8, 8, generator=generator), torch.tensor([700.0]),
            torch.randn(1, 77, 192, generator=generator), torch.randn(1, 176, generator=generator))


def _converted_layer(real, layer: str):
    """`layer` after conversion: itself or, where its projection group became one GEMM, its rows of
    that GEMM as a layer of their own."""
    parent_name, _, name = layer.rpartition(".")
    parent = real.get_submodule(parent_name)
    if hasattr(parent, name):
        return getattr(parent, name)
    names, fused_name = next(group for group in projection_groups(parent, SDXL.attention_projections) if name in group[0])
    fused = getattr(parent, fused_name)
    rows = slice(names.index(name) * fused.out_features // len(names), (names.index(name) + 1) * fused.out_features // len(names))
    return Fp8Linear(fused.weight_fp8[rows], fused.weight_scale, fused.input_inverse_scale,
                                   fused.input_scale, None if fused.bias is None else fused.bias[rows], fused.out_dtype)


def test_fp8_layers_take_every_scale_from_the_checkpoint_and_match_fake_quantization(fp8_l3):
    _, fake = _restored(fp8_l3)
    sites = {(s.layer, s.role): s for s in quantized_inputs(fake)}
    with torch.no_grad():
        expected = UNetGraph(fake)(*_unet_inputs())
        fake_weights = {layer: fake.get_submodule(layer).weight_quantizer(fake.get_submodule(layer).weight)
                        for layer, role in sites if role == "weight"}
    _, real = _restored(fp8_l3)
    fake_calls = {}
    for layer, role in sites:
        if role == "weight":
            fake.get_submodule(layer).register_forward_hook(
                lambda _m, args, out, layer=layer: fake_calls.__setitem__(layer, (args[0], out)))
    with torch.no_grad():
        UNetGraph(fake)(*_unet_inputs())
    converted = torch_backend.convert_quantized(real, SDXL, str(fp8_l3), "fp8")
    assert converted.layers == len(fake_weights) > 100 and converted.attention == 0
    assert any(isinstance(module, Fp8Conv2d) for module in real.modules())
    for (layer, role), site in sites.items():
        module = _converted_layer(real, layer)
        if role == "input":
            assert float(module.input_scale) == pytest.approx(float(site.amax) / 448, rel=1e-6)
        elif isinstance(module, (Fp8Linear, Fp8Conv2d)):
            assert float(module.weight_scale) == pytest.approx(float(site.amax) / 448, rel=1e-6)
            weight = module.weight_fp8.float() * module.weight_scale
            if isinstance(module, Fp8Conv2d):
                weight = weight.permute(0, 3, 1, 2)
            assert torch.equal(weight, fake_weights[layer])
        else:
            assert torch.equal(module.weight, fake_weights[layer])
    assert not any(isinstance(m, QuantModule) for m in real.modules())
    with torch.no_grad():
        # Each FP8 layer on its fake-quant twin's own input: the same result but for the GEMM's
        # summation order.
        for layer, (inputs, fake_output) in fake_calls.items():
            output = _converted_layer(real, layer)(inputs)
            assert (output - fake_output).norm() / fake_output.norm() < 1e-5, layer
        actual = UNetGraph(real)(*_unet_inputs())
    # The whole UNet: a float ulp of summation order moves an activation lying on an FP8 rounding
    # boundary to the next FP8 value, and such flips compound over the layers (1e-6 on one CPU's
    # kernel, 7e-3 on another's), so only their size is bounded here.
    assert (actual - expected).norm() / expected.norm() < 3e-2
    # ModelOpt's module classes are gone, so torch.compile sees the whole UNet as one graph.
    assert torch._dynamo.explain(UNetGraph(real))(*_unet_inputs()).graph_break_count == 0


def test_fused_geglus_leave_the_converted_unets_output_as_it_was(fp8_l3):
    from diffusers.models.attention import FeedForward

    from sdquant.runtime.kernels.fp8_geglu import Fp8Geglu, fuse_geglus

    _, real = _restored(fp8_l3)
    torch_backend.convert_quantized(real, SDXL, str(fp8_l3), "fp8")
    feed_forwards = [module for module in real.modules() if isinstance(module, FeedForward)]
    with torch.no_grad():
        expected = UNetGraph(real)(*_unet_inputs())
        assert fuse_geglus(real) == len(feed_forwards) > 0
        actual = UNetGraph(real)(*_unet_inputs())
    assert all(isinstance(module.net[0], Fp8Geglu) for module in feed_forwards)
    # On the CPU the op runs the twin of the layers it replaced, in the same precision.
    assert torch.equal(actual, expected)
    assert torch._dynamo.explain(UNetGraph(real))(*_unet_inputs()).graph_break_count == 0


def _image(tmp_path, *overrides, model="scenes_sdxl", size=64, steps=20):
    run_infer(compose_config("sd_xl_trt_inference", [
        f"model={model}", "backend=torch", "device=cpu", f"out_path={tmp_path}", f"sampling.prompts={SCENE_PROMPTS}",
        f"sampling.steps={steps}", f"sampling.width={size}", f"sampling.height={size}", "num_warmup_runs=0",
        "sampling.batch_size=2", *overrides]))
    return np.stack([np.asarray(Image.open(tmp_path / f"image_000_{i:02d}.png")) / 255.0 for i in range(2)])


def _psnr(a, b) -> float:
    from skimage.metrics import peak_signal_noise_ratio

    return float(peak_signal_noise_ratio(a, b, data_range=1.0))


def test_fp8_gemm_images_stay_within_half_a_db_of_fake_quant_images(tiny_fp8_l3, tmp_path):
    # The tiny UNet and few steps: CPUs whose oneDNN has only its reference FP8 kernel take
    # seconds per call of even this UNet.
    settings = {"model": "tiny_sdxl", "steps": 6}
    fp16 = _image(tmp_path / "fp16", **settings)
    fake = _image(tmp_path / "fake", f"quantized_unet={tiny_fp8_l3}", **settings)
    real = _image(tmp_path / "real", f"quantized_unet={tiny_fp8_l3}", "torch_backend.quantized=fp8", **settings)
    print(f"PSNR against fp16: fake quant {_psnr(fp16, fake):.2f} dB, FP8 GEMMs {_psnr(fp16, real):.2f} dB; "
          f"against each other {_psnr(fake, real):.2f} dB")
    # Random weights turn each summation-order flip into noise: 0.48 dB apart with two CPU threads and
    # 0.73 with one on an Intel Xeon, so the bound is 1 dB, and the two stay far closer to each
    # other than wrong FP8 scales would leave them (38.4 dB with two threads, 40.9 with one).
    assert abs(_psnr(fp16, real) - _psnr(fp16, fake)) < 1.0
    assert _psnr(fake, real) > 36


def test_compiled_pipeline_draws_the_eager_image(tmp_path, model_cache):
    eager = _image(tmp_path / "eager", model="tiny_sdxl", steps=2)
    compiled = _image(tmp_path / "compiled", "torch_backend.compile=true", model="tiny_sdxl", steps=2)
    assert _psnr(eager, compiled) > 40


@pytest.mark.parametrize("mode, mode_options", [
    ("default", {}),
    ("reduce-overhead", {"triton.cudagraphs": True}),
    ("max-autotune-no-cudagraphs", {"max_autotune": True, "coordinate_descent_tuning": True}),
])
def test_compile_keeps_its_mode_and_tunes_the_fused_kernels_when_asked(mode, mode_options):
    from sdquant.config import TorchBackendBlock

    tuned = torch_backend.compile_settings(TorchBackendBlock(compile=True, compile_mode=mode, tune_kernels=True))
    assert tuned == {"options": {**mode_options, "coordinate_descent_tuning": True}}
    assert torch_backend.compile_settings(TorchBackendBlock(compile=True, compile_mode=mode)) == {"mode": mode}


def test_in_slices_runs_the_graph_a_slice_at_a_time_and_keeps_each_output_before_the_next_call():
    seen = []
    # As the compiler's own CUDA graphs do: every call writes its output into the same memory.
    static = torch.empty(2, 1)

    def graph(batch):
        seen.append(len(batch))
        output = static[:len(batch)]
        output.copy_(batch * 2)
        return output

    batch = torch.arange(5.0).reshape(5, 1)
    assert torch.equal(torch_backend.InSlices(graph, 2)(batch), batch * 2)
    assert seen == [2, 2, 1]
    seen.clear()
    torch_backend.InSlices(graph, 8)(batch[:2])
    assert seen == [2]


class _Reduction:
    """What inductor's choice reads of a reduction kernel: its kind and its row length."""

    def __init__(self, hint, numel: int):
        import sympy

        self.hint, self.reduction_numel = hint, sympy.Integer(numel)

    def get_reduction_hint(self):
        return self.hint


def test_compiling_stages_reduce_rows_up_to_2048_wide_in_registers(tiny_pipeline):
    """The choice reaches inductor through its hook for the compiling thread and keeps SDXL's
    1280-wide LayerNorm rows in registers, not wider rows nor reductions across rows; a GPU's
    compile then writes persistent kernels for them (triton_per_* in
    benchmarks/results/sdxl_rows_h100_b8.json)."""
    from torch._inductor.choices import InductorChoices
    from torch._inductor.graph import GraphLowering
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    from sdquant.config import TorchBackendBlock

    with V.set_choices_handler(InductorChoices()):
        pipe = tiny_pipeline("tiny_sdxl")
        torch_backend.speed_up(pipe, SDXL, SDXL.torch_stages(pipe, torch.float32), TorchBackendBlock(compile=True),
                               cuda_graph=False, quantized=False)
        chosen = V.choices
    with V.set_graph_handler(GraphLowering(torch.fx.symbolic_trace(torch.nn.Identity()))):
        def persistent(choices, hint, numel):
            return choices.should_use_persistent_reduction(_Reduction(hint, numel), False)

        assert persistent(chosen, ReductionHint.INNER, 1280) and not persistent(InductorChoices(), ReductionHint.INNER, 1280)
        assert not persistent(chosen, ReductionHint.INNER, 4096)
        assert persistent(chosen, ReductionHint.OUTER, 1280) == persistent(InductorChoices(), ReductionHint.OUTER, 1280)


@pytest.mark.parametrize("model", ["tiny_sdxl", "tiny_flux", "tiny_sd3"])
def test_every_family_decoder_stage_decodes_vae_batch_images_at_a_time(tiny_pipeline, model):
    from sdquant.config import TorchBackendBlock
    from sdquant.families import family_of

    pipe = tiny_pipeline(model)
    family = family_of(compose_config("sd_xl_quantize", [f"model={model}"]).model.family)
    stages = torch_backend.speed_up(pipe, family, family.torch_stages(pipe, torch.float32), TorchBackendBlock(),
                                    cuda_graph=False, quantized=False)
    decoded = []
    pipe.vae.decoder.register_forward_pre_hook(lambda module, args: decoded.append(len(args[0])))
    channels = pipe.vae.config.latent_channels
    images = stages["vae"](latent=torch.randn(3, channels, 4, 4))["images"]
    assert decoded == [1, 1, 1] and len(images) == 3


def test_vae_decoding_one_image_at_a_time_draws_the_whole_batch_images(tmp_path, model_cache):
    settings = {"model": "tiny_sdxl", "steps": 2}
    sliced = _image(tmp_path / "sliced", "torch_backend.vae_batch=1", **settings)
    whole = _image(tmp_path / "whole", "torch_backend.vae_batch=0", **settings)
    # The same decoder on the same latents: a convolution's summation order may differ with the
    # batch, which moves a pixel by a level at most.
    assert np.abs(sliced - whole).max() <= 1 / 255 + 1e-9


@pytest.mark.parametrize("overrides, key", [
    (["backend=onnxruntime", "torch_backend.compile=true"], "backend=onnxruntime"),
    (["torch_backend.quantized=fp8"], "quantized_backbone"),
    (["torch_backend.compile_mode=fastest"], "torch_backend.compile_mode"),
    (["torch_backend.vae_batch=-1"], "torch_backend.vae_batch"),
    (["torch_backend.tune_kernels=true"], "torch_backend.tune_kernels=true tunes the kernels torch.compile makes"),
    (["backend=onnxruntime", "torch_backend.vae_batch=0"], "vae_batch .*apply to backend=torch"),
])
def test_torch_backend_settings_that_cannot_apply_are_refused(tmp_path, overrides, key):
    with pytest.raises(UserError, match=key):
        run_infer(compose_config("sd_xl_trt_inference", ["model=scenes_sdxl", "backend=torch", "device=cpu",
                                                         f"out_path={tmp_path}", *overrides]))
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


# An op of sdquant's namespace that loses an argument between two versions; each process compiles a
# function calling it, through one inductor cache.
_PROBE = """
import sys, torch
from sdquant.runtime.torch_backend import tag_compile_cache
old = sys.argv[1] == "old"
schema = "(Tensor x, float s, bool flag=False) -> Tensor" if old else "(Tensor x, float s) -> Tensor"
torch.library.define("sdquant::cache_probe", schema)
torch.library.impl("sdquant::cache_probe", "cpu", lambda x, s, flag=False: x * s)
torch.library.register_fake("sdquant::cache_probe", lambda x, s, flag=False: torch.empty_like(x))
probe = torch.ops.sdquant.cache_probe
tag_compile_cache()
compiled = torch.compile(lambda x: (probe(x.sin(), 2.0, False) if old else probe(x.sin(), 2.0)).cos())
print(compiled(torch.zeros(4)).tolist())
"""


def test_compiled_code_of_an_ops_older_schema_is_not_reused(tmp_path):
    import os
    import subprocess
    import sys

    # Inductor's own cache key leaves out arguments at their defaults: without the ops' schemas in
    # the key, the second process gets the first's code, which passes `flag`, and fails.
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "OMP_NUM_THREADS": "1"}
    for version in ("old", "new"):
        result = subprocess.run([sys.executable, "-c", _PROBE, version], env=env, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, f"{version}: {result.stderr[-2000:]}"
        assert result.stdout.strip().endswith("[1.0, 1.0, 1.0, 1.0]")


def test_the_cache_tag_keeps_the_users_and_holds_one_of_its_own():
    # The config's own patch, not monkeypatch: undoing a setattr on torch's config module hides the
    # option from every later test in the process.
    with torch.compiler.config.patch(cache_key_tag="mine"):
        torch_backend.tag_compile_cache()
        torch_backend.tag_compile_cache()
        tag = torch.compiler.config.cache_key_tag
    assert tag.startswith("mine sdquant-ops-") and tag.count("sdquant-ops-") == 1
