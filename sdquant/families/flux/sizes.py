"""Flux's architectures: the tiny one for tests, Flux.1-dev's for benchmarks, and its pipeline built
at any of them (or a scene model's) with random weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import components
from ..base import SEED


@dataclass(frozen=True)
class FluxSizes:
    """A Flux architecture: CLIP and T5 encoders, the transformer's blocks and heads, a 16-channel
    AutoencoderKL."""

    clip_width: int
    clip_layers: int
    clip_heads: int
    t5_width: int
    t5_layers: int
    t5_heads: int
    t5_head_width: int
    t5_ff: int
    double_blocks: int
    single_blocks: int
    heads: int
    head_dim: int
    rope_axes: tuple[int, int, int]
    vae_channels: tuple[int, ...]
    vae_groups: int
    vae_layers: int
    image_size: int
    guidance: bool = True
    clip_activation: str = "quick_gelu"
    # Flux.1's latent scaling and shift (a scene model's are set by its training).
    vae_config: tuple = (("scaling_factor", 0.3611), ("shift_factor", 0.1159))


TINY = FluxSizes(clip_width=32, clip_layers=2, clip_heads=1, t5_width=32, t5_layers=2, t5_heads=4, t5_head_width=8,
                 t5_ff=64, double_blocks=2, single_blocks=2, heads=2, head_dim=16, rope_axes=(4, 6, 6),
                 vae_channels=(8, 8, 16, 16), vae_groups=8, vae_layers=2, image_size=64)

# Flux.1-dev's sizes; its VAE as Flux.1's (16 latent channels).
FULL = FluxSizes(clip_width=768, clip_layers=12, clip_heads=12, t5_width=4096, t5_layers=24, t5_heads=64,
                 t5_head_width=64, t5_ff=10240, double_blocks=19, single_blocks=38, heads=24, head_dim=128,
                 rope_axes=(16, 56, 56), vae_channels=(128, 256, 512, 512), vae_groups=32, vae_layers=2,
                 image_size=1024)


def flux_scheduler():
    """Flux.1-dev's flow-matching scheduler, which shifts the noise levels by the image's token count."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096,
                                           max_shift=1.15, shift=3.0, use_dynamic_shifting=True)


def build_pipeline(sizes: FluxSizes, tokenizers: dict | None = None):
    """CLIP and T5 encoders, a FluxTransformer2DModel and a 16-channel AutoencoderKL, with
    Flux.1-dev's flow-matching scheduler (dynamic shifting)."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(SEED)
    tokenizers = tokenizers or {}
    clip_tokenizer = tokenizers.get("clip") or components.byte_level_tokenizer()
    t5_tokenizer = tokenizers.get("t5") or components.char_t5_tokenizer()
    clip = components.clip_text_encoder(clip_tokenizer, sizes.clip_width, sizes.clip_layers, sizes.clip_heads,
                                        activation=sizes.clip_activation)
    t5 = components.t5_text_encoder(t5_tokenizer, sizes.t5_width, sizes.t5_layers, sizes.t5_heads,
                                    sizes.t5_head_width, sizes.t5_ff)
    latent_channels = 16
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * latent_channels, num_layers=sizes.double_blocks,
        num_single_layers=sizes.single_blocks, attention_head_dim=sizes.head_dim, num_attention_heads=sizes.heads,
        joint_attention_dim=sizes.t5_width, pooled_projection_dim=sizes.clip_width,
        guidance_embeds=sizes.guidance, axes_dims_rope=sizes.rope_axes)
    vae = components.autoencoder(sizes.vae_channels, sizes.vae_groups, sizes.vae_layers, latent_channels,
                                 sizes.image_size, use_quant_conv=False, use_post_quant_conv=False,
                                 **dict(sizes.vae_config))
    return FluxPipeline(scheduler=flux_scheduler(), vae=vae, text_encoder=clip, tokenizer=clip_tokenizer,
                        text_encoder_2=t5, tokenizer_2=t5_tokenizer, transformer=transformer)
