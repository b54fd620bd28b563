"""cuDNN's FP8 attention (torch.ops.sdquant.fp8_attention on CUDA; and FlashAttention-3's, where it
is installed) against the op's twin
(sdquant.runtime.kernels.fp8_attention.reference_attention, run here on the same GPU tensors): on the
full-size SDXL and Flux attention shapes, on every converted attention layer of the scene models,
and compiled with torch.compile and replayed as a CUDA graph. Skipped without a CUDA GPU; needs a
Hopper or newer GPU and nvidia-cudnn-frontend.

Run on the GPU machine:
    pip install --no-deps .whl/nvidia_cudnn_frontend-*.whl
    python -m pytest -m gpu tests/test_fp8_attention_gpu.py -n 0 -s

The twin rounds softmax's output to FP8 at range 1 as ModelOpt's fake quantization and TensorRT
do; cuDNN rounds each probability relative to its row's running maximum before dividing by the
row's sum, which is finer. So the two are not equal: each test bounds their difference and checks
that cuDNN is no further than the twin from the same attention computed in fp32 without rounding
the softmax. -s prints the measured errors.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from sdquant.runtime import torch_backend
from sdquant.runtime.kernels import fp8_attention as kernels
from sdquant.runtime.kernels.fp8 import fp8_scales, to_fp8

from conftest import FAST_QUANTIZE, compose_config, restored_backbones

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none is visible here)")]

CUDA = torch.device("cuda")
# The twin against cuDNN, relative: rounding the output to FP8 alone moves it 2.6% (relative
# norm) from the exact value, and two such roundings of slightly different values land 3.7%
# apart; with their different softmax rounding, a CPU model of cuDNN's rounding came 4.8-5.0% from
# the twin on these shapes' random data. A wrong scale, layout or softmax scale is off by far more.
TWIN_BOUND = 0.08


@pytest.fixture(scope="module", autouse=True)
def cudnn_kernel():
    missing = kernels.cuda_kernel_missing(CUDA)
    if missing and "Hopper" in missing:
        pytest.skip(missing)
    assert missing is None, f"{missing}: pip install --no-deps .whl/nvidia_cudnn_frontend-*.whl"


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _compare(q, k, v, scales: dict, out_inverse: torch.Tensor, what: str, flash3: bool = False) -> None:
    """cuDNN's output (`flash3`: FlashAttention-3's) against the twin's, and both against fp32
    attention without softmax rounding."""
    softmax_scale = q.shape[-1] ** -0.5
    args = (q, k, v, scales["q"], scales["k"], scales["v"], softmax_scale, out_inverse)
    kernel = "FlashAttention-3" if flash3 else "cuDNN"
    if flash3:
        # The op's fake against what FlashAttention-3 returns (dtype, shape, strides).
        torch.library.opcheck(torch.ops.sdquant.flash3_fp8_attention.default, args[:7], test_utils=("test_faketensor",))
    kernel_out = kernels.flash3_attention_rounded(*args) if flash3 else torch.ops.sdquant.fp8_attention(*args)
    twin_out = kernels.reference_attention(*args)
    assert kernel_out.shape == twin_out.shape and kernel_out.stride() == twin_out.stride(), \
        f"{what}: {kernel}'s output is {tuple(kernel_out.shape)} strides {kernel_out.stride()}, the twin's " \
        f"{tuple(twin_out.shape)} strides {twin_out.stride()}"
    exact = F.scaled_dot_product_attention(*(x.float() * scales[role] for role, x in zip("qkv", (q, k, v))))
    out_scale = 1 / out_inverse
    kernel_value, twin_value = kernel_out.float() * out_scale, twin_out.float() * out_scale
    apart, kernel_error, twin_error = (_relative(kernel_value, twin_value), _relative(kernel_value, exact),
                                       _relative(twin_value, exact))
    print(f"{what}: {kernel} against the twin {apart:.4f}; against fp32 attention {kernel} {kernel_error:.4f}, "
          f"the twin {twin_error:.4f}")
    assert torch.isfinite(kernel_value).all(), f"{what}: {kernel}'s output holds NaN or inf"
    assert apart < TWIN_BOUND, f"{what}: {kernel}'s FP8 attention is {apart:.4f} (relative) from the twin's, over " \
                               f"{TWIN_BOUND}: more than rounding (a scale, layout or softmax scale?)"
    assert kernel_error < twin_error * 1.5 + 0.01, \
        f"{what}: {kernel} is {kernel_error:.4f} from fp32 attention, the twin {twin_error:.4f}: {kernel} rounds worse"


def skip_without_flash3() -> None:
    """FlashAttention-3 is optional (fa3-fwd, in the fp8-attention extra, or benchmarks/build_flash3.sh's
    wheel): its rows skip where it is not installed."""
    from sdquant.runtime.attention import flash3_missing

    missing = flash3_missing(CUDA)
    if missing:
        pytest.skip(missing)


@pytest.mark.parametrize("flash3", [False, True], ids=["torch", "flash3"])
def test_a_windowed_layer_attends_to_its_frames_on_the_gpus_kernels(flash3):
    """A video's self-attention within 1 latent frame (5 frames of 1,024 tokens, 8 heads of 128),
    bf16 and FP8 on the layer's kernels (torch's SDPA and cuDNN's FP8, or FlashAttention-3's),
    against attention in fp32 masked to each query's frames; in FP8 with half the heads within
    the window and the others over every key too."""
    from sdquant.runtime.attention import FLASH3, Fp8Attention, attend, provide_diffusers_flash3
    from sdquant.runtime.attention_window import WINDOW, WINDOW_HEADS, HeadSplit, TemporalWindow

    if flash3:
        skip_without_flash3()
        # The layer is marked by hand, not by use_attention_kernel, which would hand diffusers'
        # FlashAttention-3 backend fa3-fwd's function: without it the 16-bit call fails whenever
        # no earlier test in this worker has marked a model.
        provide_diffusers_flash3()
    generator = torch.Generator(CUDA).manual_seed(0)
    per_frame, heads = 1024, 8
    q, k, v = (torch.randn(1, 5 * per_frame, heads, 128, device=CUDA, generator=generator, dtype=torch.bfloat16)
               for _ in range(3))
    frame = torch.arange(q.shape[1], device=CUDA) // per_frame
    mask = (frame[:, None] - frame[None, :]).abs() <= 1
    exact = F.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (q, k, v)), attn_mask=mask)
    exact = exact.transpose(1, 2).flatten(2)
    window = TemporalWindow(1, None)
    window.tokens_per_frame = per_frame
    layer = torch.nn.Module()
    setattr(layer, WINDOW, window)
    setattr(layer, FLASH3, flash3)
    apart = _relative(attend(layer, q, k, v), exact)
    print(f"bf16 within 1 frame{' (flash3)' if flash3 else ''}: {apart:.4f} from fp32")
    assert apart < 0.01, f"the windowed bf16 attention is {apart:.4f} from the masked fp32 attention"
    dense = F.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (q, k, v))).transpose(1, 2).flatten(2)
    assert _relative(dense, exact) > 10 * apart, "the window left the attention as it was"
    reader = types.SimpleNamespace(input_inverse_scale=None, input_scale=None)
    out_inverse, out_scale = fp8_scales(exact.abs().amax())
    reader.input_inverse_scale, reader.input_scale = out_inverse, out_scale
    amax = {role: x.abs().amax().float() for role, x in zip("qkv", (q, k, v))}
    fp8 = Fp8Attention(amax, reader)
    layer.fp8_attention = fp8
    fp8_out = fp8.dequantize(attend(layer, q, k, v), torch.float32)
    apart = _relative(fp8_out, exact)
    print(f"FP8 within 1 frame{' (flash3)' if flash3 else ''}: {apart:.4f} from fp32")
    assert apart < TWIN_BOUND, f"the windowed FP8 attention is {apart:.4f} from the masked fp32 attention"
    # Every other head within the window, the others over every key (a heads file's split).
    setattr(layer, WINDOW_HEADS, HeadSplit(inside=(0, 2, 4, 6), outside=(1, 3, 5, 7)))
    expected = exact.unflatten(2, (heads, 128)).clone()
    expected[:, :, 1::2] = dense.unflatten(2, (heads, 128))[:, :, 1::2]
    apart = _relative(fp8.dequantize(attend(layer, q, k, v), torch.float32), expected.flatten(2))
    print(f"FP8 within 1 frame for half the heads{' (flash3)' if flash3 else ''}: {apart:.4f} from fp32")
    assert apart < TWIN_BOUND, f"the split heads' FP8 attention is {apart:.4f} from fp32's"


def _quantized(x: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
    """Rounds x to FP8 into `into` with x's own range, as a calibrated range would; its scale."""
    inverse, scale = fp8_scales(x.abs().amax())
    into.copy_(to_fp8(x, inverse))
    return scale


@pytest.mark.parametrize("shape", [
    # SDXL's 64x64-latent self-attention at 1024x1024, two samples (guidance), q/k/v read from one
    # fused GEMM's output: (batch, tokens, 3, heads, head_dim) memory.
    pytest.param(dict(batch=2, heads=10, tokens=4096, keys=4096, head_dim=64, fused=True), id="sdxl_self_4096"),
    # Flux's joint attention at 1024x1024: 512 text and 4096 image tokens, q/k/v apart.
    pytest.param(dict(batch=1, heads=24, tokens=4608, keys=4608, head_dim=128, fused=False), id="flux_joint_4608"),
    # SDXL's cross-attention (77 keys), which level 4 keeps in 16 bits; older level-4 checkpoints
    # quantized it.
    pytest.param(dict(batch=2, heads=10, tokens=4096, keys=77, head_dim=64, fused=False), id="sdxl_cross_77"),
])
@pytest.mark.parametrize("flash3", [False, True], ids=["cudnn", "flash3"])
def test_cudnn_fp8_attention_matches_the_twin_on_full_size_shapes(shape, flash3):
    if flash3:
        skip_without_flash3()
    generator = torch.Generator(CUDA).manual_seed(0)
    batch, heads, head_dim = shape["batch"], shape["heads"], shape["head_dim"]

    def fp8(tokens: int, count: int) -> torch.Tensor:
        return torch.empty(batch, tokens, count, heads, head_dim, device=CUDA, dtype=torch.float8_e4m3fn)

    # (batch, tokens, heads, head_dim) memory, one buffer for all three where one GEMM wrote them.
    if shape["fused"]:
        qkv = fp8(shape["tokens"], 3)
        memory = [qkv[:, :, i] for i in range(3)]
    else:
        memory = [fp8(shape["tokens"], 1)[:, :, 0], fp8(shape["keys"], 1)[:, :, 0], fp8(shape["keys"], 1)[:, :, 0]]
    scales = {role: _quantized(torch.randn(x.shape, device=CUDA, generator=generator, dtype=torch.bfloat16), x)
              for role, x in zip("qkv", memory)}
    # Read as (batch, heads, tokens, head_dim), without a copy.
    q, k, v = (x.transpose(1, 2) for x in memory)
    exact = F.scaled_dot_product_attention(*(x.float() * scales[role] for role, x in zip("qkv", (q, k, v))))
    _compare(q, k, v, scales, fp8_scales(exact.abs().amax())[0], f"{shape}{' flash3' if flash3 else ''}", flash3)


def _scene_backbone(model: str, folder):
    from sdquant.families import family_of

    config = compose_config("sd_xl_quantize", [f"model={model}"]).model
    (backbone,) = restored_backbones(model, folder).values()
    dtype = torch.bfloat16 if model == "scenes_flux" else torch.float16
    backbone.to(device=CUDA, dtype=dtype).eval()
    torch_backend.convert_quantized(backbone, family_of(config.family), str(folder), "fp8")
    return backbone, dtype


@pytest.fixture(scope="module")
def level4(tmp_path_factory):
    from sdquant.workflow.quantize import run_quantize

    # Calibrated on the CPU: the ranges are what matter here, not where they were found.
    return {model: run_quantize(compose_config("sd_xl_quantize", [
        f"model={model}", f"out_dir={tmp_path_factory.mktemp('quantized')}", "device=cpu", *FAST_QUANTIZE,
        "quantize.format=fp8", "quantize.quant_level=4"])) for model in ("scenes_sdxl", "scenes_flux")}


def _stage_inputs(model: str, dtype, seed: int) -> dict[str, torch.Tensor]:
    """One call's inputs of the scene model's backbone stage, at its 64x64 pixels."""
    generator = torch.Generator(CUDA).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device=CUDA, generator=generator).to(dtype)

    if model == "scenes_sdxl":
        return {"x": randn(2, 4, 16, 16), "timesteps": torch.full((2,), 700.0, device=CUDA),
                "context": randn(2, 77, 192), "y": randn(2, 176)}
    rows, columns = torch.meshgrid(torch.arange(8, device=CUDA), torch.arange(8, device=CUDA), indexing="ij")
    image_ids = torch.stack([torch.zeros_like(rows), rows, columns], dim=-1).reshape(-1, 3).float()
    return {"hidden_states": randn(1, 64, 64), "encoder_hidden_states": randn(1, 32, 128),
            "pooled_projections": randn(1, 64), "timestep": torch.full((1,), 0.7, device=CUDA, dtype=dtype),
            "img_ids": image_ids, "txt_ids": torch.zeros(32, 3, device=CUDA)}


def _stage(model: str, backbone, dtype):
    from sdquant.families import family_of

    return family_of("sdxl" if model == "scenes_sdxl" else "flux").backbone_stage(backbone, dtype)


@pytest.mark.parametrize("model", ["scenes_sdxl", "scenes_flux"])
def test_every_converted_scene_layer_runs_cudnn_within_bounds_of_its_twin(level4, model):
    backbone, dtype = _scene_backbone(model, level4[model])
    layers = {name: module for name, module in backbone.named_modules() if name.endswith(".fp8_attention")}
    assert layers, f"{model}: no attention layer was converted to FP8 attention"
    seen = {}

    def keep(name: str):
        def hook(module, args, _out):
            seen.setdefault(name, (module, args))
        return hook

    hooks = [module.register_forward_hook(keep(name)) for name, module in layers.items()]
    _stage(model, backbone, dtype)(**_stage_inputs(model, dtype, seed=0))
    for hook in hooks:
        hook.remove()
    assert seen.keys() == layers.keys()
    for name, (module, (query, key, value, *_)) in seen.items():
        fp8 = [to_fp8(x, getattr(module, f"{role}_inverse_scale")) for role, x in zip("qkv", (query, key, value))]
        scales = {role: getattr(module, f"{role}_scale") for role in "qkv"}
        _compare(*fp8, scales, module.out_inverse_scale, f"{model} {name} {tuple(query.shape)}")


@pytest.mark.parametrize("flash3", [False, True], ids=["cudnn", "flash3"])
@pytest.mark.parametrize("model", ["scenes_sdxl", "scenes_flux"])
def test_compiled_graph_replay_of_fp8_attention_gives_the_eager_output(level4, model, flash3):
    if flash3:
        skip_without_flash3()
    from sdquant.runtime.attention import use_attention_kernel

    backbone, dtype = _scene_backbone(model, level4[model])
    use_attention_kernel(backbone, "flash3" if flash3 else "torch")
    # cuDNN's graphs are cached per shape across tests: only this test's build counts below.
    kernels._GRAPHS.clear()
    eager_stage = _stage(model, backbone, dtype)
    compiled_stage = _stage(model, backbone, dtype)
    # Compiled as torch_backend.speed_up compiles it.
    compiled_stage.graph = torch.compile(compiled_stage.graph)
    replayed = torch_backend.GraphReplayStage(compiled_stage)
    for seed in range(3):
        inputs = _stage_inputs(model, dtype, seed)
        eager = next(iter(eager_stage(**inputs).values()))
        got = next(iter(replayed(**inputs).values()))
        error = _relative(got, eager)
        print(f"{model} call {seed}: compiled and replayed against eager {error:.2e}")
        # Inductor fuses the q/k/v rounding into other kernels, whose fp32 arithmetic (where eager
        # rounds each op to 16 bits) can move a value across an FP8 rounding boundary; a wrong replay
        # (stale inputs, an attention kernel left out of the graph) is off by far more.
        assert error < 5e-2, f"{model} call {seed}: the CUDA graph replay is {error:.3e} from the eager call"
    # cuDNN's kernel ran where asked, and no FP8 attention fell back to it under FlashAttention-3.
    assert bool(kernels._GRAPHS) != flash3, f"cuDNN graphs built: {len(kernels._GRAPHS)} (flash3={flash3})"


def test_flux_forms_compiled_and_replayed_give_the_plain_models_output(level4):
    """The forms the compiled torch backend gives Flux (q and k in rotary halves order, every AdaLN
    modulation precomputed by its own stage), compiled and replayed as a CUDA graph, against the
    same checkpoint run eager without them."""
    import types

    from sdquant.families.flux import FLUX
    from sdquant.runtime.step_modulations import MODULATIONS

    plain, dtype = _scene_backbone("scenes_flux", level4["scenes_flux"])
    formed, _ = _scene_backbone("scenes_flux", level4["scenes_flux"])
    FLUX.use_family_forms(formed)
    modulations = FLUX.generation_stages(types.SimpleNamespace(transformer=formed))[MODULATIONS]
    stage = _stage("scenes_flux", formed, dtype)
    stage.graph = torch.compile(stage.graph)
    replayed = torch_backend.GraphReplayStage(stage)
    for seed in range(3):
        inputs = _stage_inputs("scenes_flux", dtype, seed)
        want = next(iter(_stage("scenes_flux", plain, dtype)(**inputs).values()))
        rows = modulations(pooled_projections=inputs["pooled_projections"], timestep=inputs["timestep"])[MODULATIONS]
        got = next(iter(replayed(**{**inputs, "pooled_projections": rows}).values()))
        error = _relative(got, want)
        print(f"scenes_flux call {seed}: with the forms, compiled and replayed, against plain eager {error:.2e}")
        # As in the test above: FP8 roundings that fused fp32 arithmetic moves, nothing more.
        assert error < 5e-2, f"call {seed}: {error:.3e} from the plain model"
