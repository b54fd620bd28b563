"""Stable Diffusion pipelines built from config in code, with random weights.

Two sizes of the same architectures: ``tiny`` (SDXL: two CLIP encoders, text-time add_embedding,
linear projections; SD 1.5: one encoder, at toy widths) lets every stage run on a CPU where no
weights can be downloaded; ``full`` has SDXL's real layer sizes, for speed and memory benchmarks.
Tiny models are saved with ``save_pretrained`` and loaded back through ``from_pretrained`` like
any real checkpoint, so tests exercise the real loading path.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

SEED = 1234
# CLIP's window.
TOKENS_CLIP = 77


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


def _char_t5_tokenizer():
    """A T5 tokenizer (SentencePiece-style unigram) whose pieces are single characters, so any ASCII
    prompt encodes; it saves and loads as T5's own."""
    import string

    from transformers import T5TokenizerFast

    pieces = ["\u2581", *string.ascii_letters, *string.digits, *string.punctuation]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(piece, -1.0) for piece in pieces]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=512)


@dataclass(frozen=True)
class FluxSizes:
    clip_width: int
    clip_layers: int
    t5_width: int
    t5_layers: int
    t5_heads: int
    t5_ff: int
    double_blocks: int
    single_blocks: int
    heads: int
    head_dim: int
    rope_axes: tuple[int, int, int]
    vae_channels: tuple[int, ...]
    vae_groups: int
    image_size: int
    guidance: bool = True


TINY_FLUX = FluxSizes(clip_width=32, clip_layers=2, t5_width=32, t5_layers=2, t5_heads=4, t5_ff=64,
                      double_blocks=2, single_blocks=2, heads=2, head_dim=16, rope_axes=(4, 6, 6),
                      vae_channels=(8, 8, 16, 16), vae_groups=8, image_size=64)

# Flux.1-dev's sizes (random weights); its VAE as Flux.1's (16 latent channels).
FULL_FLUX_DEV = FluxSizes(clip_width=768, clip_layers=12, t5_width=4096, t5_layers=24, t5_heads=64, t5_ff=10240,
                          double_blocks=19, single_blocks=38, heads=24, head_dim=128, rope_axes=(16, 56, 56),
                          vae_channels=(128, 256, 512, 512), vae_groups=32, image_size=1024)


def build_flux_pipeline(sizes: FluxSizes = None):
    """A FluxPipeline at `sizes` (the tiny one by default): CLIP and T5 encoders, a
    FluxTransformer2DModel and a 16-channel AutoencoderKL, random weights from a fixed seed, and
    Flux.1-dev's flow-matching scheduler (dynamic shifting)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    sizes = sizes or TINY_FLUX
    torch.manual_seed(SEED)
    clip_tokenizer, t5_tokenizer = _byte_level_tokenizer(), _char_t5_tokenizer()
    clip_vocab = len(clip_tokenizer)
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=clip_vocab, hidden_size=sizes.clip_width, intermediate_size=4 * sizes.clip_width,
        num_attention_heads=max(1, sizes.clip_width // 64), num_hidden_layers=sizes.clip_layers,
        max_position_embeddings=TOKENS_CLIP, projection_dim=sizes.clip_width, bos_token_id=clip_vocab - 2,
        eos_token_id=clip_vocab - 1, pad_token_id=clip_vocab - 1, hidden_act="quick_gelu"))
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(t5_tokenizer), d_model=sizes.t5_width, d_kv=sizes.t5_width // sizes.t5_heads,
        d_ff=sizes.t5_ff, num_layers=sizes.t5_layers, num_heads=sizes.t5_heads, feed_forward_proj="gated-gelu",
        is_encoder_decoder=False, use_cache=False))
    latent_channels = 16
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * latent_channels, num_layers=sizes.double_blocks,
        num_single_layers=sizes.single_blocks, attention_head_dim=sizes.head_dim, num_attention_heads=sizes.heads,
        joint_attention_dim=sizes.t5_width, pooled_projection_dim=sizes.clip_width, guidance_embeds=sizes.guidance,
        axes_dims_rope=sizes.rope_axes)
    depth = len(sizes.vae_channels)
    vae = AutoencoderKL(
        block_out_channels=sizes.vae_channels, down_block_types=("DownEncoderBlock2D",) * depth,
        up_block_types=("UpDecoderBlock2D",) * depth, latent_channels=latent_channels,
        norm_num_groups=sizes.vae_groups, layers_per_block=2, sample_size=sizes.image_size,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    scheduler = FlowMatchEulerDiscreteScheduler(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096,
                                                max_shift=1.15, shift=3.0, use_dynamic_shifting=True)
    return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tokenizer,
                        text_encoder_2=t5, tokenizer_2=t5_tokenizer, transformer=transformer)


def build_tiny_flux():
    return build_flux_pipeline(TINY_FLUX)


def full_size_flux_on_gpu():
    """Flux.1-dev's architecture with random bf16 weights built directly on the GPU, its
    scheduler's tables on the CPU as pipelines expect."""
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            pipe = build_flux_pipeline(FULL_FLUX_DEV)
    finally:
        torch.set_default_dtype(torch.float32)
    pipe.scheduler = pipe.scheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe
