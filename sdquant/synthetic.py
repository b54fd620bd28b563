"""Stable Diffusion pipelines built from config in code, with random weights.

Two sizes of the same architectures: ``tiny`` (SDXL: two CLIP encoders, text-time add_embedding,
linear projections; SD 1.5: one encoder, at toy widths) lets every stage run on a CPU where no
weights can be downloaded; ``full`` has SDXL's real layer sizes, for speed and memory benchmarks.
Tiny models are saved with ``save_pretrained`` and loaded back through ``from_pretrained`` like
any real checkpoint, so tests exercise the real loading path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

SEED = 1234


@dataclass(frozen=True)
class Sizes:
    text_widths: tuple[int, int]        # CLIP-L-like and OpenCLIP-bigG-like encoders
    text_layers: tuple[int, int]
    text_heads: tuple[int, int]
    unet_channels: tuple[int, ...]
    unet_down: tuple[str, ...]
    unet_up: tuple[str, ...]
    unet_transformer_layers: tuple[int, ...]
    unet_head_dims: tuple[int, ...]
    unet_groups: int
    time_id_width: int
    vae_channels: tuple[int, ...]
    vae_groups: int
    vae_layers: int
    latent_size: int


TINY = Sizes(
    text_widths=(32, 32), text_layers=(3, 3), text_heads=(4, 4),
    unet_channels=(32, 64), unet_down=("DownBlock2D", "CrossAttnDownBlock2D"),
    unet_up=("CrossAttnUpBlock2D", "UpBlock2D"), unet_transformer_layers=(1, 2),
    unet_head_dims=(2, 4), unet_groups=16, time_id_width=8,
    vae_channels=(8, 8, 16, 16), vae_groups=8, vae_layers=1, latent_size=8,
)

# SDXL base 1.0's sizes (random weights).
FULL_SDXL = Sizes(
    text_widths=(768, 1280), text_layers=(12, 32), text_heads=(12, 20),
    unet_channels=(320, 640, 1280),
    unet_down=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    unet_up=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    unet_transformer_layers=(1, 2, 10), unet_head_dims=(5, 10, 20), unet_groups=32,
    time_id_width=256, vae_channels=(128, 256, 512, 512), vae_groups=32, vae_layers=2,
    latent_size=128,
)


def _byte_level_tokenizer():
    """A CLIP tokenizer whose vocabulary is every byte, with no merges, so any prompt encodes."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    pieces = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {piece: i for i, piece in enumerate(pieces + [p + "</w>" for p in pieces])}
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def _text_encoder(sizes: Sizes, index: int, vocab_size: int, with_projection: bool):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    width = sizes.text_widths[index]
    config = CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=width, intermediate_size=4 * width,
        num_attention_heads=sizes.text_heads[index], num_hidden_layers=sizes.text_layers[index],
        max_position_embeddings=77, projection_dim=width, bos_token_id=vocab_size - 2,
        eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1, hidden_act="gelu",
    )
    return CLIPTextModelWithProjection(config) if with_projection else CLIPTextModel(config)


def _vae(sizes: Sizes):
    from diffusers import AutoencoderKL

    depth = len(sizes.vae_channels)
    return AutoencoderKL(
        block_out_channels=sizes.vae_channels, down_block_types=("DownEncoderBlock2D",) * depth,
        up_block_types=("UpDecoderBlock2D",) * depth, latent_channels=4,
        norm_num_groups=sizes.vae_groups, layers_per_block=sizes.vae_layers,
        sample_size=sizes.latent_size * 8, scaling_factor=0.13025,
    )


def build_unet(sizes: Sizes, sdxl: bool):
    from diffusers import UNet2DConditionModel

    extra = {}
    if sdxl:
        extra = dict(
            addition_embed_type="text_time", addition_time_embed_dim=sizes.time_id_width,
            projection_class_embeddings_input_dim=6 * sizes.time_id_width + sizes.text_widths[1],
            transformer_layers_per_block=sizes.unet_transformer_layers, use_linear_projection=True,
        )
    return UNet2DConditionModel(
        sample_size=sizes.latent_size, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=sizes.unet_channels, down_block_types=sizes.unet_down,
        up_block_types=sizes.unet_up, attention_head_dim=sizes.unet_head_dims,
        cross_attention_dim=sum(sizes.text_widths) if sdxl else sizes.text_widths[0],
        norm_num_groups=sizes.unet_groups, **extra,
    )


def build_pipeline(family: str, sizes: Sizes = TINY):
    """A pipeline of `family` ("sdxl" or "sd15") at `sizes`, random weights from a fixed seed."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline

    torch.manual_seed(SEED)
    tokenizer = _byte_level_tokenizer()
    vocab_size = len(tokenizer)
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        timestep_spacing="leading", steps_offset=1,
    )
    if family == "sdxl":
        return StableDiffusionXLPipeline(
            vae=_vae(sizes), text_encoder=_text_encoder(sizes, 0, vocab_size, False),
            text_encoder_2=_text_encoder(sizes, 1, vocab_size, True), tokenizer=tokenizer,
            tokenizer_2=tokenizer, unet=build_unet(sizes, sdxl=True), scheduler=scheduler,
            add_watermarker=False,
        )
    return StableDiffusionPipeline(
        vae=_vae(sizes), text_encoder=_text_encoder(sizes, 0, vocab_size, False),
        tokenizer=tokenizer, unet=build_unet(sizes, sdxl=False), scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )


def build_tiny_pipeline(family: str, folder: Path) -> None:
    """Builds the tiny pipeline of `family` and saves it to `folder`."""
    build_pipeline(family, TINY).save_pretrained(folder)


def full_size_sdxl_on_gpu():
    """The full-size SDXL with random fp16 weights built directly on the GPU (seconds, not the
    minutes a CPU build and copy take), its scheduler's tables on the CPU as pipelines expect."""
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device("cuda"):
            pipe = build_pipeline("sdxl", FULL_SDXL)
    finally:
        torch.set_default_dtype(torch.float32)
    pipe.scheduler = pipe.scheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe
