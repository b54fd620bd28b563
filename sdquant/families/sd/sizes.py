"""The UNet families' architectures: SD's and SDXL's tiny ones for tests, SDXL base 1.0's for
benchmarks, and their pipelines built at any of them (or the scene model's) with random weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import components
from ..base import SEED


@dataclass(frozen=True)
class UNetSizes:
    """An SD or SDXL architecture: its text encoders (one for SD, two for SDXL), UNet and VAE."""

    text_widths: tuple[int, ...]
    text_layers: tuple[int, ...]
    text_heads: tuple[int, ...]
    unet_channels: tuple[int, ...]
    unet_down: tuple[str, ...]
    unet_up: tuple[str, ...]
    unet_transformer_layers: tuple[int, ...] | int
    unet_head_dims: tuple[int, ...]
    unet_groups: int
    vae_channels: tuple[int, ...]
    vae_groups: int
    vae_layers: int
    image_size: int
    # SDXL's text-time embedding width (the Fourier features of each of the six time ids).
    time_id_width: int = 0
    # The VAE's latent scaling (a scene model's is set by its training) and whether diffusers runs
    # it in fp32 for a half-precision pipeline.
    vae_config: tuple = (("scaling_factor", 0.13025),)

    @property
    def latent_size(self) -> int:
        return self.image_size // 2 ** (len(self.vae_channels) - 1)


def build_unet(sizes: UNetSizes, cross_attention_dim: int, **extra):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=sizes.latent_size, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=sizes.unet_channels, down_block_types=sizes.unet_down, up_block_types=sizes.unet_up,
        attention_head_dim=sizes.unet_head_dims, cross_attention_dim=cross_attention_dim,
        norm_num_groups=sizes.unet_groups, **extra)


def sd_scheduler():
    """SD's and SDXL's scaled-linear DDPM schedule, sampled by Euler with SDXL's spacing."""
    from diffusers import EulerDiscreteScheduler

    return EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                  timestep_spacing="leading", steps_offset=1)


def unet_vae(sizes: UNetSizes):
    return components.autoencoder(sizes.vae_channels, sizes.vae_groups, sizes.vae_layers, 4, sizes.image_size,
                                  **dict(sizes.vae_config))


# SD 1.5's tiny sizes: one CLIP encoder.
SD_TINY = UNetSizes(
    text_widths=(32,), text_layers=(3,), text_heads=(4,), unet_channels=(32, 64),
    unet_down=("DownBlock2D", "CrossAttnDownBlock2D"), unet_up=("CrossAttnUpBlock2D", "UpBlock2D"),
    unet_transformer_layers=(1, 2), unet_head_dims=(2, 4), unet_groups=16, vae_channels=(8, 8, 16, 16),
    vae_groups=8, vae_layers=1, image_size=64)

# SDXL's tiny sizes: two CLIP encoders, the UNet's text-time embedding.
SDXL_TINY = UNetSizes(
    text_widths=(32, 32), text_layers=(3, 3), text_heads=(4, 4), unet_channels=(32, 64),
    unet_down=("DownBlock2D", "CrossAttnDownBlock2D"), unet_up=("CrossAttnUpBlock2D", "UpBlock2D"),
    unet_transformer_layers=(1, 2), unet_head_dims=(2, 4), unet_groups=16, time_id_width=8,
    vae_channels=(8, 8, 16, 16), vae_groups=8, vae_layers=1, image_size=64)

# SDXL base 1.0's sizes.
SDXL_FULL = UNetSizes(
    text_widths=(768, 1280), text_layers=(12, 32), text_heads=(12, 20), unet_channels=(320, 640, 1280),
    unet_down=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    unet_up=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), unet_transformer_layers=(1, 2, 10),
    unet_head_dims=(5, 10, 20), unet_groups=32, time_id_width=256, vae_channels=(128, 256, 512, 512),
    vae_groups=32, vae_layers=2, image_size=1024)


def sdxl_unet(sizes: UNetSizes):
    """SDXL's UNet at `sizes`: text-time add-embeddings, linear projections in its transformers."""
    return build_unet(sizes, sum(sizes.text_widths), addition_embed_type="text_time",
                      addition_time_embed_dim=sizes.time_id_width,
                      projection_class_embeddings_input_dim=6 * sizes.time_id_width + sizes.text_widths[1],
                      transformer_layers_per_block=sizes.unet_transformer_layers, use_linear_projection=True)


def build_sd_pipeline(sizes: UNetSizes, tokenizers: dict | None = None):
    from diffusers import StableDiffusionPipeline

    torch.manual_seed(SEED)
    tokenizer = (tokenizers or {}).get("clip") or components.byte_level_tokenizer()
    return StableDiffusionPipeline(
        vae=unet_vae(sizes),
        text_encoder=components.clip_text_encoder(tokenizer, sizes.text_widths[0], sizes.text_layers[0],
                                                  sizes.text_heads[0]),
        tokenizer=tokenizer, unet=build_unet(sizes, sizes.text_widths[0]), scheduler=sd_scheduler(),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def build_sdxl_pipeline(sizes: UNetSizes, tokenizers: dict | None = None):
    from diffusers import StableDiffusionXLPipeline

    torch.manual_seed(SEED)
    tokenizer = (tokenizers or {}).get("clip") or components.byte_level_tokenizer()
    # Built in this order (VAE, encoders, UNet), so the tiny model's weights stay what they were.
    vae = unet_vae(sizes)
    encoders = [components.clip_text_encoder(tokenizer, width, layers, heads, projection=index == 1)
                for index, (width, layers, heads) in enumerate(zip(sizes.text_widths, sizes.text_layers,
                                                                   sizes.text_heads))]
    unet = sdxl_unet(sizes)
    return StableDiffusionXLPipeline(vae=vae, text_encoder=encoders[0], text_encoder_2=encoders[1],
                                     tokenizer=tokenizer, tokenizer_2=tokenizer, unet=unet,
                                     scheduler=sd_scheduler(), add_watermarker=False)
