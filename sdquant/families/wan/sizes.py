"""Wan2.2's architectures: the tiny ones for tests, the A14B's and the TI2V-5B's for benchmarks, and
the pipeline built at any of them (or the scene model's) with random weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import components
from ..base import SEED
from .flow import UMT5_TOKENS


@dataclass(frozen=True)
class WanSizes:
    """A Wan architecture: UMT5, each expert, the Wan VAE, and the scheduler's flow shift."""

    text_width: int
    text_layers: int
    text_heads: int
    text_head_width: int
    text_ff: int
    heads: int
    head_dim: int
    ffn: int
    layers: int
    latent_channels: int
    freq_dim: int
    rope_max_tokens: int
    # AutoencoderKLWan's arguments (lists where it takes lists), as (name, value) pairs.
    vae: tuple
    flow_shift: float
    # The tokenizer's length, which the UMT5 sequence takes (WanPipeline's 512 for the real models).
    text_tokens: int = UMT5_TOKENS


TINY = WanSizes(text_width=32, text_layers=2, text_heads=4, text_head_width=8, text_ff=64, heads=2, head_dim=16,
                ffn=64, layers=5, latent_channels=16, freq_dim=32, rope_max_tokens=64, flow_shift=3.0, text_tokens=64,
                vae=(("base_dim", 8), ("z_dim", 16), ("dim_mult", [1, 1, 1, 1]), ("num_res_blocks", 1),
                     ("temperal_downsample", [False, True, True])))
# Wan2.2-T2V-A14B: each expert 40 blocks of 40 heads of 128 (14.3 B parameters), UMT5-XXL, the Wan2.1 VAE
# (AutoencoderKLWan's defaults), UniPC with diffusers' flow shift of 3.
FULL = WanSizes(text_width=4096, text_layers=24, text_heads=64, text_head_width=64, text_ff=10240, heads=40,
                head_dim=128, ffn=13824, layers=40, latent_channels=16, freq_dim=256, rope_max_tokens=1024,
                flow_shift=3.0, vae=())
# The Wan2.2 VAE's 48 latent channels as random weights take them (a trained VAE's folder states its
# own per-channel mean and std).
UNIT_STATISTICS_48 = (("latents_mean", [0.0] * 48), ("latents_std", [1.0] * 48))
# Wan2.2-TI2V-5B: 30 blocks of 24 heads of 128, 48 latent channels, the Wan2.2 VAE (16x, residual,
# 2x2 pixel patches), flow shift 5.
TI2V_FULL = WanSizes(text_width=4096, text_layers=24, text_heads=64, text_head_width=64, text_ff=10240, heads=24,
                     head_dim=128, ffn=14336, layers=30, latent_channels=48, freq_dim=256, rope_max_tokens=1024,
                     flow_shift=5.0,
                     vae=(("base_dim", 160), ("decoder_base_dim", 256), ("z_dim", 48), ("is_residual", True),
                          ("in_channels", 12), ("out_channels", 12), ("patch_size", 2), ("scale_factor_spatial", 16),
                          *UNIT_STATISTICS_48))
TI2V_TINY = WanSizes(text_width=32, text_layers=2, text_heads=4, text_head_width=8, text_ff=64, heads=2, head_dim=16,
                     ffn=64, layers=5, latent_channels=48, freq_dim=32, rope_max_tokens=64, flow_shift=5.0,
                     text_tokens=64,
                     vae=(("base_dim", 8), ("decoder_base_dim", 12), ("z_dim", 48), ("is_residual", True),
                          ("in_channels", 12), ("out_channels", 12), ("patch_size", 2), ("scale_factor_spatial", 16),
                          ("dim_mult", [1, 1, 1, 1]), ("num_res_blocks", 1),
                          ("temperal_downsample", [False, True, True]), *UNIT_STATISTICS_48))


def umt5_encoder(tokenizer, sizes: WanSizes):
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=sizes.text_width, d_kv=sizes.text_head_width, d_ff=sizes.text_ff,
        num_layers=sizes.text_layers, num_heads=sizes.text_heads, feed_forward_proj="gated-gelu",
        is_encoder_decoder=False, use_cache=False))


def expert(sizes: WanSizes):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=sizes.heads, attention_head_dim=sizes.head_dim,
        in_channels=sizes.latent_channels, out_channels=sizes.latent_channels, text_dim=sizes.text_width,
        freq_dim=sizes.freq_dim, ffn_dim=sizes.ffn, num_layers=sizes.layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=sizes.rope_max_tokens)


def build_pipeline(sizes: WanSizes, experts: tuple[str, ...], boundary_ratio: float | None, expand_timesteps: bool,
                   tokenizers: dict | None = None):
    """UMT5, the experts (by attribute) and the Wan VAE at `sizes`, with UniPC over flow sigmas; two
    experts split at `boundary_ratio`."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    torch.manual_seed(SEED)
    tokenizer = (tokenizers or {}).get("t5") or components.char_t5_tokenizer(sizes.text_tokens)
    modules = {attribute: expert(sizes) for attribute in experts}
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=sizes.flow_shift)
    boundary = {"boundary_ratio": boundary_ratio} if len(experts) > 1 else {}
    return WanPipeline(tokenizer=tokenizer, text_encoder=umt5_encoder(tokenizer, sizes),
                       vae=AutoencoderKLWan(**dict(sizes.vae)), scheduler=scheduler,
                       expand_timesteps=expand_timesteps, **modules, **boundary)
