"""The layer forms the torch backend compiles (sdquant.runtime.compiled_forms) compute what
diffusers' layers compute: GroupNorm with per-channel statistics, and wide-headed attention on
diffusers' sliced GEMM processor; the forms are given to the layers they are for and no others,
and torch_backend.compile gives them to the decoder, and to a backbone that runs in 8 bits, whose
block outputs it also pins channels-last: that changes no value, eager or compiled, and leaves the
compiler no channels-first activation to lay out."""

from __future__ import annotations

import re

import pytest
import torch
from diffusers import AutoencoderKL
from diffusers.models.attention_processor import Attention, AttnProcessor2_0, SlicedAttnProcessor

from sdquant.config import TorchBackendBlock
from sdquant.families.sd import SDXL
from sdquant.runtime import torch_backend
from sdquant.families.dit import adaln_norms
from sdquant.families.flux import FLUX
from sdquant.families.flux.family import BLOCK_STACKS
from sdquant.families.flux.graphs import FluxTorchAttnProcessor, TransformerGraph, use_rotary_halves
from sdquant.runtime.compiled_forms import (ChannelStatisticsGroupNorm, SigmoidTanhGELU, SigmoidTanhGELUProjection,
                                            pin_channels_last_outputs, reorder_outputs, tanh_gelu,
                                            use_compiled_forms, use_sigmoid_gelu)
from sdquant.runtime.kernels.fp8_layers import Fp8Linear
from sdquant.runtime.kernels.int8 import Int8Linear
from sdquant.runtime.step_modulations import StepModulations, precompute_modulations


@pytest.mark.parametrize("shape, groups", [((2, 64, 12, 10), 32), ((2, 96, 7, 7), 8), ((3, 48, 40), 4)])
def test_group_norm_with_channel_statistics_gives_group_norm_in_float64(shape, groups):
    generator = torch.Generator().manual_seed(0)
    norm = torch.nn.GroupNorm(groups, shape[1], eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(generator=generator)
        norm.bias.normal_(generator=generator)
    # An offset far larger than the spread: the variance must come from centred values, not from
    # the mean of squares (torch's own channels-last GroupNorm on a CPU is 2e-2 off here).
    x = torch.randn(shape, generator=generator, dtype=torch.float64).mul(0.5).add(40).float()
    if x.dim() == 4:
        x = x.to(memory_format=torch.channels_last)
    exact = torch.nn.functional.group_norm(x.double(), groups, norm.weight.double(), norm.bias.double(), norm.eps)
    norm.__class__ = ChannelStatisticsGroupNorm
    got = norm(x)
    assert got.dtype == x.dtype and got.stride() == x.stride()
    assert (got.double() - exact).abs().max() < 1e-4 * exact.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tanh_gelu_through_a_sigmoid_gives_torchs_tanh_gelu(dtype):
    # Wide enough for both tails: for large negative inputs 1 + tanh(z) cancels in torch's form.
    x = torch.linspace(-12, 12, 100_001).to(dtype)
    exact = torch.nn.functional.gelu(x.double(), approximate="tanh")
    got = tanh_gelu(x)
    torchs = torch.nn.functional.gelu(x, approximate="tanh")
    assert got.dtype == dtype
    # Within one rounding of the output's format of the exact value, as torch's own is (checked
    # too, so that the bound is one torch meets).
    resolution = torch.finfo(dtype).eps
    assert ((got.double() - exact).abs() <= resolution * exact.abs() + 1e-6).all()
    assert ((torchs.double() - exact).abs() <= resolution * exact.abs() + 1e-6).all()


def test_sigmoid_gelu_goes_to_tanh_gelus_only():
    from diffusers.models.activations import GELU

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.GELU(approximate="tanh"), torch.nn.GELU(), GELU(8, 16, approximate="tanh"),
                                GELU(16, 8))
    x = torch.randn(3, 8)
    with torch.no_grad():
        want = model(x)
        use_sigmoid_gelu(model)
        got = model(x)
    assert [type(m) for m in model] == [SigmoidTanhGELU, torch.nn.GELU, SigmoidTanhGELUProjection, GELU]
    assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("model", ["tiny_flux", "tiny_sd3"])
@pytest.mark.parametrize("quantized", [False, True])
def test_compiling_gives_every_backbone_the_sigmoid_gelu(tiny_pipeline, model, quantized):
    from diffusers.models.activations import GELU

    from sdquant.families import family_of

    from conftest import compose_config

    pipe = tiny_pipeline(model)
    family = family_of(compose_config("sd_xl_quantize", [f"model={model}"]).model.family)
    tanh_gelus = sum(type(m) in (torch.nn.GELU, GELU) and m.approximate == "tanh" for m in pipe.transformer.modules())
    stages = torch_backend.speed_up(pipe, family, family.torch_stages(pipe, torch.float32),
                                    TorchBackendBlock(compile=True), cuda_graph=False, quantized=quantized)
    forms = [m for m in pipe.transformer.modules() if type(m) in (SigmoidTanhGELU, SigmoidTanhGELUProjection)]
    assert tanh_gelus and len(forms) == tanh_gelus
    assert not any(type(m) in (torch.nn.GELU, GELU) for m in pipe.transformer.modules())
    # Flux's own form: every attention layer's q and k in rotary halves order.
    halves = [getattr(m.processor, "rotary_halves", False) for m in pipe.transformer.modules() if hasattr(m, "processor")]
    assert halves and all(halves) == (model == "tiny_flux")
    # Every AdaLN modulation precomputed, by a stage of its own.
    precomputed = isinstance(pipe.transformer.time_text_embed, StepModulations)
    assert precomputed and "modulations" in stages


def test_a_cache_hook_leaves_flux_computing_its_modulations_at_each_step(tiny_pipeline):
    """Under a hook the compiler compiles block by block, where the modulations' columns would give
    every block code of its own (use_step_modulations says why)."""
    from sdquant.runtime.cache_hooks import HookCache

    pipe = tiny_pipeline("tiny_flux")
    cache = HookCache("taylorseer", 2, 0.0, BLOCK_STACKS)
    stages = torch_backend.speed_up(pipe, FLUX, FLUX.torch_stages(pipe, torch.float32, cache),
                                    TorchBackendBlock(compile=True), cuda_graph=False, quantized=False)
    assert not isinstance(pipe.transformer.time_text_embed, StepModulations) and "modulations" not in stages


def _flux_call(transformer) -> torch.Tensor:
    """One call of a tiny Flux transformer on seeded inputs: 4x4 packed image tokens, 8 text tokens."""
    config = transformer.config
    generator = torch.Generator().manual_seed(0)
    rows, columns = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
    image_ids = torch.stack([torch.zeros_like(rows), rows, columns], dim=-1).reshape(-1, 3).float()
    guidance = torch.tensor([3.5]) if config.guidance_embeds else None
    with torch.no_grad():
        return TransformerGraph(transformer)(
            torch.randn(1, 16, config.in_channels, generator=generator),
            torch.randn(1, 8, config.joint_attention_dim, generator=generator),
            torch.randn(1, config.pooled_projection_dim, generator=generator), torch.tensor([0.7]), image_ids,
            torch.zeros(8, 3), guidance)


@pytest.mark.parametrize("fused", [False, True])
def test_flux_q_k_features_in_rotary_halves_order_give_the_same_transformer(fused):
    transformer = FLUX.build_pipeline(FLUX.sizes["tiny"]).transformer.float().eval()
    want = _flux_call(transformer)
    if fused:
        transformer.fuse_qkv_projections()
    assert use_rotary_halves(transformer)
    layers = [m for m in transformer.modules() if hasattr(m, "processor")]
    assert layers and all(type(attn.processor) is FluxTorchAttnProcessor and attn.processor.rotary_halves
                          for attn in layers)
    got = _flux_call(transformer)
    # The same products and sums: only the q/k norms add their squares in another order.
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    # Once: a second reorder would scramble what the first ordered, even with diffusers' processors
    # set again (they would then rotate the wrong pairs, but the weights stay as they are).
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    assert not use_rotary_halves(transformer)
    assert (_flux_call(transformer) - got).abs().max() == 0
    transformer.set_attn_processor(FluxAttnProcessor())
    weights = {name: tensor.clone() for name, tensor in transformer.state_dict().items()}
    assert not use_rotary_halves(transformer)
    assert all(torch.equal(tensor, weights[name]) for name, tensor in transformer.state_dict().items())
    transformer.set_attn_processor(FluxTorchAttnProcessor(rotary_halves=True))
    # In diffusers' order, q and k would be rotated by the wrong angles.
    for attn in layers:
        attn.processor.rotary_halves = False
    assert (_flux_call(transformer) - want).abs().max() > 1e-2 * want.abs().max()


def test_rotary_halves_are_all_or_nothing():
    from diffusers.models.attention_processor import AttnProcessor2_0

    transformer = FLUX.build_pipeline(FLUX.sizes["tiny"]).transformer.float().eval()
    # A layer whose processor reads the tables in diffusers' order (here one that is not Flux's at all).
    transformer.single_transformer_blocks[0].attn.processor = AttnProcessor2_0()
    weights = {name: tensor.clone() for name, tensor in transformer.state_dict().items()}
    assert not use_rotary_halves(transformer)
    assert all(torch.equal(tensor, weights[name]) for name, tensor in transformer.state_dict().items())
    assert not transformer.pos_embed._forward_hooks


@pytest.mark.parametrize("guidance", [True, False])
def test_flux_modulations_precomputed_for_every_step_give_each_steps_transformer(guidance):
    """Two images over three steps: the stage's rows, handed to the transformer in place of the
    pooled text, give what each step's call computed itself."""
    import dataclasses

    from sdquant.families.flux.graphs import ModulationsGraph

    transformer = FLUX.build_pipeline(dataclasses.replace(FLUX.sizes["tiny"], guidance=guidance)).transformer
    transformer = transformer.float().eval()
    config = transformer.config
    generator = torch.Generator().manual_seed(1)
    latents, text = torch.randn(2, 16, config.in_channels, generator=generator), torch.randn(2, 8, 32, generator=generator)
    pooled = torch.randn(2, config.pooled_projection_dim, generator=generator)
    timesteps, guidance_scale = torch.tensor([1.0, 0.6, 0.25]), torch.tensor([3.5, 2.0]) if guidance else None
    rows, columns = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
    image_ids = torch.stack([torch.zeros_like(rows), rows, columns], dim=-1).reshape(-1, 3).float()

    def calls(conditioning) -> list[torch.Tensor]:
        with torch.no_grad():
            return [TransformerGraph(transformer)(latents * t, text, condition, t.expand(2), image_ids,
                                                  torch.zeros(8, 3), guidance_scale)
                    for t, condition in zip(timesteps, conditioning)]

    want = calls([pooled] * len(timesteps))
    adalns = 2 * config.num_layers + config.num_single_layers + 1
    assert precompute_modulations(transformer, adaln_norms())
    assert len(transformer.time_text_embed.layers) == adalns
    with torch.no_grad():
        inputs = (pooled.repeat(3, 1), timesteps.repeat_interleave(2)) + ((guidance_scale.repeat(3),) if guidance else ())
        modulations = ModulationsGraph(transformer)(*inputs).unflatten(0, (3, 2))
    assert modulations.shape[-1] == transformer.time_text_embed.width
    for got, expected in zip(calls(modulations), want):
        assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    # Once; and a call with the pooled text itself is refused, naming what it takes.
    assert not precompute_modulations(transformer, adaln_norms())
    with pytest.raises(ValueError, match=f"{transformer.time_text_embed.width} modulations as pooled_projections"):
        calls([pooled])


def test_reordered_outputs_are_the_layers_outputs_in_that_order():
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 12)
    x = torch.randn(5, 16)
    order = torch.randperm(12)
    per_channel_amax = linear.weight.detach().abs().amax(dim=1)
    # SmoothQuant's scale is per input feature, which the reorder leaves alone.
    smoothing = torch.rand(16) + 0.5
    layers = {"linear": linear, "fp8": Fp8Linear.from_linear(linear, torch.tensor(0.5), torch.tensor(3.0)),
              "int8": Int8Linear(linear, per_channel_amax, torch.tensor(3.0), smoothing)}
    for name, layer in layers.items():
        with torch.no_grad():
            want = layer(x)[:, order]
            reorder_outputs(layer, order)
            got = layer(x)
        # Row by row the same products: equal, the per-channel INT8 scales moved with their rows.
        assert torch.equal(got, want), name


def test_wide_headed_attention_on_the_gemm_processor_gives_sdpas_output():
    torch.manual_seed(0)
    attn = Attention(query_dim=320, heads=1, dim_head=320, norm_num_groups=8, residual_connection=True,
                     rescale_output_factor=1.0, bias=True, upcast_softmax=True, _from_deprecated_attn_block=True)
    attn.eval()
    x = torch.randn(2, 320, 6, 5)
    with torch.no_grad():
        want = attn(x)
        use_compiled_forms(attn)
        assert type(attn.processor) is SlicedAttnProcessor
        got = attn(x)
    assert (got - want).abs().max() < 1e-4 * want.abs().max()


def test_forms_go_to_group_norms_and_wide_heads_only():
    vae = AutoencoderKL(block_out_channels=(32, 288), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=8, latent_channels=4)
    narrow = Attention(query_dim=64, heads=2, dim_head=32)
    use_compiled_forms(vae)
    use_compiled_forms(narrow)
    norms = [m for m in vae.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert norms and all(type(m) is ChannelStatisticsGroupNorm for m in norms)
    # The VAE's mid-block attention has one head of 288 channels, wider than fused kernels take.
    wide = [m for m in vae.modules() if isinstance(m, Attention)]
    assert wide and all(type(m.processor) is SlicedAttnProcessor for m in wide)
    assert type(narrow.processor) is AttnProcessor2_0


@pytest.mark.parametrize("quantized", [False, True])
def test_compiling_gives_the_forms_to_the_decoder_and_to_an_8_bit_backbone(quantized):
    pipe = SDXL.build_pipeline(SDXL.sizes["tiny"])
    torch_backend.speed_up(pipe, SDXL, SDXL.torch_stages(pipe, torch.float32), TorchBackendBlock(compile=True),
                           cuda_graph=False, quantized=quantized)
    assert {type(m) for m in pipe.vae.modules() if isinstance(m, torch.nn.GroupNorm)} == {ChannelStatisticsGroupNorm}
    backbone_norm = ChannelStatisticsGroupNorm if quantized else torch.nn.GroupNorm
    assert {type(m) for m in pipe.unet.modules() if isinstance(m, torch.nn.GroupNorm)} == {backbone_norm}
    assert bool(pipe.unet.down_blocks[0].resnets[0]._forward_hooks) == quantized, "block outputs pinned"


def _four_d_buffers(code: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(shape, strides) of every 4-D buffer the compiled code allocates."""
    numbers = r"\((\d+), (\d+), (\d+), (\d+)\)"
    return [(tuple(map(int, m.groups()[:4])), tuple(map(int, m.groups()[4:])))
            for m in re.finditer(rf"empty_strided_\w+\({numbers}, {numbers}", code)]


def test_pinned_block_outputs_leave_the_compiled_unet_no_channels_first_activation():
    """Unpinned, the compiler lays the tiny UNet's concatenated skip connection (128 channels at
    16x16) out channels-first (seen in its code); pinned, every activation it allocates is
    channels-last (a GroupNorm's statistics, one value a row, are not activations), and the
    outputs, eager and compiled, are the unpinned UNet's."""
    from torch._inductor.utils import run_and_get_code

    pipe = SDXL.build_pipeline(SDXL.sizes["tiny"])
    unet = pipe.unet.eval().to(memory_format=torch.channels_last)
    generator = torch.Generator().manual_seed(0)
    inputs = dict(sample=torch.randn(2, unet.config.in_channels, 32, 32, generator=generator),
                  timestep=torch.tensor([500.0, 500.0]),
                  encoder_hidden_states=torch.randn(2, 77, unet.config.cross_attention_dim, generator=generator),
                  added_cond_kwargs={"text_embeds": torch.randn(2, pipe.text_encoder_2.config.projection_dim,
                                                                generator=generator),
                                     "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]] * 2)})
    with torch.no_grad():
        want = unet(**inputs).sample
        pin_channels_last_outputs(unet)
        assert torch.equal(unet(**inputs).sample, want)
        got, (code, *_) = run_and_get_code(torch.compile(unet), **inputs)
    assert (got.sample - want).abs().max() < 1e-4 * want.abs().max()
    activations = [(shape, strides) for shape, strides in _four_d_buffers(code) if shape[1] > 1 and shape[3] > 1]
    assert activations, "the compiled code allocates activations"
    assert [(shape, strides) for shape, strides in activations if strides[1] != 1] == []
