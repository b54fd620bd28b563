"""Tiny Stable Diffusion pipelines built from config in code.

They have the real architectures (SDXL: two CLIP encoders, text-time add_embedding, linear
projections; SD 1.5: one encoder) at toy widths, so every stage of the toolkit can run on a CPU
where no weights can be downloaded. They are saved with ``save_pretrained`` and then loaded back
through ``from_pretrained`` like any real checkpoint, so tests exercise the real loading path.
"""

from __future__ import annotations

from pathlib import Path

import torch

TEXT_WIDTH = 32
LATENT_SIZE = 8  # 64x64 pixels after the VAE's 8x upsampling, as for SD's 1/8 latents
SEED = 1234


def _tiny_tokenizer():
    """A byte-level CLIP vocabulary: every byte as a word piece, no merges, so any prompt encodes."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    pieces = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {piece: i for i, piece in enumerate(pieces + [p + "</w>" for p in pieces])}
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def _text_encoder_config(vocab_size: int, with_projection: bool):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=TEXT_WIDTH,
        intermediate_size=64,
        num_attention_heads=4,
        num_hidden_layers=3,
        max_position_embeddings=77,
        projection_dim=TEXT_WIDTH if with_projection else 512,
        bos_token_id=vocab_size - 2,
        eos_token_id=vocab_size - 1,
        pad_token_id=vocab_size - 1,
        hidden_act="gelu",
    )


def _tiny_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=(8, 8, 16, 16),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4,
        norm_num_groups=8,
        layers_per_block=1,
        sample_size=LATENT_SIZE * 8,
    )


def _tiny_unet(cross_attention_dim: int, sdxl: bool):
    from diffusers import UNet2DConditionModel

    extra = {}
    if sdxl:
        extra = dict(
            addition_embed_type="text_time",
            addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=6 * 8 + TEXT_WIDTH,
            transformer_layers_per_block=(1, 2),
            use_linear_projection=True,
        )
    return UNet2DConditionModel(
        sample_size=LATENT_SIZE,
        in_channels=4,
        out_channels=4,
        layers_per_block=2,
        block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        cross_attention_dim=cross_attention_dim,
        norm_num_groups=16,
        **extra,
    )


def build_tiny_pipeline(family: str, folder: Path) -> None:
    """Builds the tiny pipeline of `family` with a fixed seed and saves it to `folder`."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(SEED)
    tokenizer = _tiny_tokenizer()
    vocab_size = len(tokenizer)
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", timestep_spacing="leading",
        steps_offset=1,
    )
    if family == "sdxl":
        pipe = StableDiffusionXLPipeline(
            vae=_tiny_vae(),
            text_encoder=CLIPTextModel(_text_encoder_config(vocab_size, False)),
            text_encoder_2=CLIPTextModelWithProjection(_text_encoder_config(vocab_size, True)),
            tokenizer=tokenizer,
            tokenizer_2=tokenizer,
            unet=_tiny_unet(2 * TEXT_WIDTH, sdxl=True),
            scheduler=scheduler,
            add_watermarker=False,
        )
    else:
        pipe = StableDiffusionPipeline(
            vae=_tiny_vae(),
            text_encoder=CLIPTextModel(_text_encoder_config(vocab_size, False)),
            tokenizer=tokenizer,
            unet=_tiny_unet(TEXT_WIDTH, sdxl=False),
            scheduler=scheduler,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
    pipe.save_pretrained(folder)
