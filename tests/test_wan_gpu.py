"""One full-size Wan2.2-T2V-A14B block at MLPerf's video shape (81 frames of 720x1280: 75,600 tokens
of 40 heads of 128, both guidance halves) on the GPU: cuDNN's FP8 attention
(torch.ops.sdquant.fp8_attention) against its twin, and the block quantized at level 4 and converted
to the torch backend's FP8 kernels (its GEMMs on torch._scaled_mm, its self-attention on cuDNN)
against the same block in ModelOpt's fake quantization. Skipped without a CUDA GPU; needs a Hopper
or newer GPU of 80 GB (the twins and the video's activations take tens of GB) and
nvidia-cudnn-frontend. On a fresh machine the first fake-quantized call builds ModelOpt's CUDA
extension (about a minute).

Run on the GPU machine:
    pip install --no-deps .whl/nvidia_cudnn_frontend-*.whl
    python -m pytest -m gpu tests/test_wan_gpu.py -n 0 -s

Over 75,600 keys a softmax output is 1/75,600 on average, which the twin's FP8 rounding at range 1
(ModelOpt's and TensorRT's) puts among E4M3's subnormals: a CPU model of both roundings on this
random data put the twin 6.7% from fp32 attention (3.8% at SDXL's 4096 tokens), cuDNN (which
rounds relative to the row's running maximum) 3.7%, and the two 7.6% apart, within the 8% that
test_fp8_attention_gpu.py's bounds allow. -s prints the measured errors.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from sdquant.config import QuantFormat, QuantizeBlock
from sdquant.families.wan import WAN
from sdquant.families.wan.flow import TEMPORAL_SCALE, UMT5_TOKENS, latent_frames, latent_tokens
from sdquant.families.wan.sizes import FULL
from sdquant.quantize.recipe import calibration_algorithm
from sdquant.quantize.shared_ranges import tie_fp8_ranges
from sdquant.runtime import torch_backend
from sdquant.runtime.attention import FLASH3, FP8_ATTENTION, Fp8Attention, provide_diffusers_flash3
from sdquant.runtime.kernels import fp8_attention as kernels
from sdquant.runtime.kernels.fp8 import fp8_scales
from sdquant.runtime.kernels.fp8_layers import Fp8Linear

from test_fp8_attention_gpu import _compare, _quantized, _relative, skip_without_flash3
from test_fp8_attention_gpu import cudnn_kernel  # noqa: F401  (an autouse fixture: it skips before Hopper)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none is visible here)")]

CUDA = torch.device("cuda")
# Both guidance halves in one call, as WanPipeline runs an expert.
BATCH = 2
# MLPerf's geometry, the family's default: the A14B's VAE scales 8x and packs 4 frames a latent
# frame after the first, its experts take 1x2x2 patches: 21 x 45 x 80 = 75,600 tokens.
VIDEO_LATENT = (latent_frames(WAN.default_frames, TEMPORAL_SCALE), WAN.default_size[0] // 8, WAN.default_size[1] // 8)
TOKENS = latent_tokens(*VIDEO_LATENT)
# Calibrated on 2 latent frames (7,200 tokens), which is quick: the kernels are under test at the
# video's length, whatever ranges they run with, and both sides clamp alike what the longer call's
# random inputs exceed them by.
CALIBRATION_LATENT = (2, *VIDEO_LATENT[1:])
# A middle block: the recipe keeps the first and last three of the 40 in 16 bits.
BLOCK_INDEX = "20"
LEVEL = 4.0
# The twin's queries of every sample and head at a time: its fp32 scores over 75,600 keys, 3.1 GB a
# block, would take 1.8 TB for the whole call.
QUERY_BLOCK = 128
# The converted block against fake quantization, relative, per sublayer. Both run the same FP8
# values; they part where cuDNN rounds softmax's output (fake quantization leaves it exact) and
# where the GEMMs' fast FP8 accumulation moves a value, and each small difference then moves some
# values of the next layer's input across an FP8 rounding boundary. On the CPU, with a model of
# cuDNN's rounding and the GEMMs' twins, this block at 1,024 tokens came 1.5% (attn1) to 2.9% (ffn)
# from its fake quantization; a wrong scale, layout or layer is off by the size of the output.
BLOCK_BOUND = 0.08


def _in_query_blocks(twin):
    """`twin`, with the op's arguments, run on QUERY_BLOCK queries of every sample and head at a
    time into one output in the op's layout."""

    def blocked(q, k, v, *scales):
        out = kernels._output(q, v)
        for start in range(0, q.shape[2], QUERY_BLOCK):
            rows = slice(start, start + QUERY_BLOCK)
            out[:, :, rows] = twin(q[:, :, rows], k, v, *scales)
        return out

    return blocked


@pytest.mark.parametrize("flash3", [False, True], ids=["cudnn", "flash3"])
def test_cudnn_fp8_attention_matches_the_twin_at_the_video_shape(monkeypatch, flash3):
    if flash3:
        skip_without_flash3()
    generator = torch.Generator(CUDA).manual_seed(0)
    # (batch, tokens, heads, head_dim) memory, as the block's q/k norms and rotary embedding write
    # q and k and its rounding to FP8 writes v, read as (batch, heads, tokens, head_dim).
    memory = [torch.empty(BATCH, TOKENS, FULL.heads, FULL.head_dim, device=CUDA, dtype=torch.float8_e4m3fn)
              for _ in "qkv"]
    scales = {role: _quantized(torch.randn(x.shape, device=CUDA, generator=generator, dtype=torch.bfloat16), x)
              for role, x in zip("qkv", memory)}
    q, k, v = (x.transpose(1, 2) for x in memory)
    # The output's range as a calibration would find it, from bf16 attention (seconds faster than
    # the fp32 attention _compare measures against).
    dequantized = (x.to(torch.bfloat16) * scales[role] for role, x in zip("qkv", (q, k, v)))
    out_inverse, _ = fp8_scales(F.scaled_dot_product_attention(*dequantized).abs().amax())
    # _compare's twin, a block of queries at a time.
    monkeypatch.setattr(kernels, "reference_attention", _in_query_blocks(kernels.reference_attention))
    _compare(q, k, v, scales, out_inverse, f"A14B self-attention {tuple(q.shape)}{' flash3' if flash3 else ''}",
             flash3)


def _block_inputs(latent: tuple[int, int, int], seed: int) -> dict[str, torch.Tensor]:
    """A block's inputs inside the expert for a latent of (frames, height, width): the video's
    tokens, the text as the condition embedder projects it to the block's width, the six
    modulations of the time embedding, and the rotary embedding of the tokens' positions."""
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    generator = torch.Generator(CUDA).manual_seed(seed)
    width = FULL.heads * FULL.head_dim

    def randn(*shape):
        return torch.randn(*shape, device=CUDA, generator=generator, dtype=torch.bfloat16)

    rope = WanRotaryPosEmbed(FULL.head_dim, (1, 2, 2), FULL.rope_max_tokens)
    # It reads the latent's shape only; fp32, as diffusers keeps an expert's rope (_keep_in_fp32_modules).
    rotary = rope(torch.empty(BATCH, FULL.latent_channels, *latent, device="meta"))
    return {"hidden_states": randn(BATCH, latent_tokens(*latent), width),
            "encoder_hidden_states": randn(BATCH, UMT5_TOKENS, width), "temb": randn(BATCH, 6, width),
            "rotary_emb": tuple(x.to(CUDA, torch.float32) for x in rotary)}


def _calibrated(block: torch.nn.Module) -> torch.nn.Module:
    """`block` as a middle block of an expert, quantized with the project's recipe at level 4 on one
    call and its ranges tied as quantize.py ties them; returns the expert holding it."""
    import modelopt.torch.quantization as mtq

    expert = torch.nn.Module()
    # Named as in the expert, so that the recipe's patterns (`*.attn1.`, `blocks.0.*`) apply.
    expert.blocks = torch.nn.ModuleDict({BLOCK_INDEX: block})
    config = {"quant_cfg": WAN.quant_cfg_entries(QuantFormat.fp8, LEVEL),
              "algorithm": calibration_algorithm(QuantFormat.fp8, LEVEL, QuantizeBlock.alpha)}
    inputs = _block_inputs(CALIBRATION_LATENT, seed=0)
    with torch.no_grad():
        mtq.quantize(expert, config, lambda calibrated: calibrated.blocks[BLOCK_INDEX](**inputs))
    tie_fp8_ranges(expert, WAN.attention_projections)
    return expert


@pytest.fixture(scope="module")
def level4_block():
    """A full-size A14B block of random bf16 weights at level 4: in ModelOpt's fake quantization,
    and converted to the torch backend's FP8 kernels, with what the conversion reported."""
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    torch.manual_seed(0)
    with torch.device(CUDA):
        # As WanTransformer3DModel builds its blocks (sdquant.families.wan.sizes.expert).
        block = WanTransformerBlock(FULL.heads * FULL.head_dim, FULL.ffn, FULL.heads, qk_norm="rms_norm_across_heads",
                                    cross_attn_norm=True, eps=1e-6)
    fake = _calibrated(block.to(torch.bfloat16).eval())
    fp8 = copy.deepcopy(fake)
    conversion = torch_backend.convert_quantized(fp8, WAN, "the test's level-4 block", "fp8", "auto", LEVEL)
    return fake.blocks[BLOCK_INDEX], fp8.blocks[BLOCK_INDEX], conversion


def test_the_level4_block_runs_its_gemms_and_only_its_self_attention_in_fp8(level4_block):
    _, fp8, conversion = level4_block
    # q, k, v and out of both attentions and the feed-forward's two layers; FP8 attention on attn1.
    assert (conversion.layers, conversion.attention) == (10, 1)
    assert isinstance(getattr(fp8.attn1, FP8_ATTENTION), Fp8Attention) and not hasattr(fp8.attn2, FP8_ATTENTION)
    # Self-attention's q, k and v as one GEMM, cross-attention's k and v (which read the text) as one.
    gemms = {name for name, module in fp8.named_modules() if isinstance(module, Fp8Linear)}
    assert gemms == {"attn1.to_qkv", "attn1.to_out.0", "attn2.to_q", "attn2.to_kv", "attn2.to_out.0",
                     "ffn.net.0.proj", "ffn.net.2"}
    assert not any(type(module) is torch.nn.Linear for module in fp8.modules())


SUBLAYERS = ("attn1", "attn2", "ffn")


def _outputs(block: torch.nn.Module, inputs: dict, modules: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The output of each of `block`'s `modules` in one call, and what the block added to its input."""
    outputs = {}
    hooks = [block.get_submodule(name).register_forward_hook(
        lambda _module, _args, out, name=name: outputs.update({name: out})) for name in modules]
    try:
        with torch.no_grad():
            outputs["block"] = block(**inputs).float() - inputs["hidden_states"].float()
    finally:
        for hook in hooks:
            hook.remove()
    return outputs


# Before the GPU path took the values' mean out of FP8 attention (Fp8Attention.forward), attn1 came
# 0.488 from fake quantization at 75,600 tokens on an H100 (0.05 at 7,200;
# benchmarks/results/wan_fp8_attention_length_h100.txt); with it, 0.0135 (attn2 0.029, ffn 0.030,
# the block 0.025; benchmarks/results/gpu_tests_wan_centred_h100.log).
@pytest.mark.parametrize("flash3", [False, True], ids=["cudnn", "flash3"])
def test_the_fp8_block_computes_what_its_fake_quantization_does_at_the_video_shape(level4_block, flash3):
    fake, fp8, _ = level4_block
    if flash3:
        skip_without_flash3()
        # What use_attention_kernel does before it marks the layers: diffusers' backend gets the
        # FlashAttention-3 installed.
        provide_diffusers_flash3()
    # Both attentions (FP8 self-attention, bf16 cross-attention) on FlashAttention-3's kernels, or
    # on cuDNN's and torch's.
    for attn in (fp8.attn1, fp8.attn2):
        setattr(attn, FLASH3, flash3)
    inputs = _block_inputs(VIDEO_LATENT, seed=1)
    expected = _outputs(fake, inputs, SUBLAYERS)
    fp8_attention = f"attn1.{FP8_ATTENTION}"
    got = _outputs(fp8, inputs, (*SUBLAYERS, fp8_attention))
    # Self-attention ran FP8 attention over the whole video, on the GPU's kernel.
    attended = got.pop(fp8_attention)
    assert attended.dtype == torch.float8_e4m3fn and attended.shape == (BATCH, FULL.heads, TOKENS, FULL.head_dim)
    for name, want in expected.items():
        assert torch.isfinite(got[name]).all(), f"{name}: the FP8 block's output holds NaN or inf"
        error = _relative(got[name], want)
        print(f"A14B block at {TOKENS} tokens{' (flash3)' if flash3 else ''}, {name}: FP8 kernels against fake "
              f"quantization {error:.4f}")
        assert error < BLOCK_BOUND, f"{name}: the FP8 kernels are {error:.4f} (relative) from fake quantization"
