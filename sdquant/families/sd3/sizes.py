"""SD3.5's architectures: the tiny one for tests, SD3.5-large's for benchmarks, and its pipeline
built at either with random weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import components
from ..base import SEED


@dataclass(frozen=True)
class SD3Sizes:
    """An SD3 architecture: CLIP-L and CLIP-G encoders (both with projections), a T5 encoder, the
    MMDiT's blocks and heads, a 16-channel AutoencoderKL."""

    clip_widths: tuple[int, int]
    clip_layers: tuple[int, int]
    clip_heads: tuple[int, int]
    t5_width: int
    t5_layers: int
    t5_heads: int
    t5_head_width: int
    t5_ff: int
    layers: int
    heads: int
    head_dim: int
    # The side of the position grid (in patches) that images are cropped from.
    pos_embed_max_size: int
    # Blocks with SD3.5-medium's second, image-only attention.
    dual_attention_layers: tuple[int, ...]
    vae_channels: tuple[int, ...]
    vae_groups: int
    vae_layers: int
    image_size: int


# Three blocks: one with SD3.5-medium's dual attention, one plain, and the last, whose text stream
# ends at its attention; RMS-normed q and k, as in both SD3.5 models. CLIP-G wider than CLIP-L and
# both narrower than T5 together, so the order of the encoders and the padding show in the states.
TINY = SD3Sizes(clip_widths=(32, 48), clip_layers=(2, 2), clip_heads=(2, 3), t5_width=96, t5_layers=2, t5_heads=4,
                t5_head_width=16, t5_ff=128, layers=3, heads=2, head_dim=16, pos_embed_max_size=16,
                dual_attention_layers=(0,), vae_channels=(8, 8, 16, 16), vae_groups=8, vae_layers=2, image_size=64)

# SD3.5-large's sizes: CLIP-L, OpenCLIP bigG's text tower, T5-XXL, 38 blocks of 38 heads x 64.
FULL = SD3Sizes(clip_widths=(768, 1280), clip_layers=(12, 32), clip_heads=(12, 20), t5_width=4096, t5_layers=24,
                t5_heads=64, t5_head_width=64, t5_ff=10240, layers=38, heads=38, head_dim=64, pos_embed_max_size=192,
                dual_attention_layers=(), vae_channels=(128, 256, 512, 512), vae_groups=32, vae_layers=2,
                image_size=1024)

# CLIP-L's activation, then CLIP-G's.
CLIP_ACTIVATIONS = ("quick_gelu", "gelu")


def build_pipeline(sizes: SD3Sizes, tokenizers: dict | None = None):
    """CLIP-L, CLIP-G and T5 encoders, an SD3Transformer2DModel and a 16-channel AutoencoderKL
    with SD3's latent scaling and shift, and SD3's flow-matching scheduler (shift 3)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(SEED)
    tokenizers = tokenizers or {}
    clip_tokenizer = tokenizers.get("clip") or components.byte_level_tokenizer()
    t5_tokenizer = tokenizers.get("t5") or components.char_t5_tokenizer()
    clip_l, clip_g = (components.clip_text_encoder(clip_tokenizer, width, layers, heads, projection=True,
                                                   activation=activation)
                      for width, layers, heads, activation in zip(sizes.clip_widths, sizes.clip_layers,
                                                                  sizes.clip_heads, CLIP_ACTIVATIONS))
    t5 = components.t5_text_encoder(t5_tokenizer, sizes.t5_width, sizes.t5_layers, sizes.t5_heads,
                                    sizes.t5_head_width, sizes.t5_ff)
    latent_channels = 16
    vae_scale = 2 ** (len(sizes.vae_channels) - 1)
    transformer = SD3Transformer2DModel(
        sample_size=sizes.image_size // vae_scale, patch_size=2, in_channels=latent_channels,
        num_layers=sizes.layers, attention_head_dim=sizes.head_dim, num_attention_heads=sizes.heads,
        joint_attention_dim=sizes.t5_width, caption_projection_dim=sizes.heads * sizes.head_dim,
        pooled_projection_dim=sum(sizes.clip_widths), out_channels=latent_channels,
        pos_embed_max_size=sizes.pos_embed_max_size, dual_attention_layers=sizes.dual_attention_layers,
        qk_norm="rms_norm")
    vae = components.autoencoder(sizes.vae_channels, sizes.vae_groups, sizes.vae_layers, latent_channels,
                                 sizes.image_size, use_quant_conv=False, use_post_quant_conv=False,
                                 scaling_factor=1.5305, shift_factor=0.0609)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=clip_l, tokenizer=clip_tokenizer, text_encoder_2=clip_g, tokenizer_2=clip_tokenizer,
        text_encoder_3=t5, tokenizer_3=t5_tokenizer)
