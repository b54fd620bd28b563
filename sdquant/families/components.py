"""Builders of the parts that families' pipelines share, from config in code with random weights:
tokenizers that encode any prompt without a download, CLIP and T5 text encoders, an AutoencoderKL.
Each family's builder puts its pipeline together from these, at its tiny, full-size or scene sizes.
"""

from __future__ import annotations

# CLIP's window.
CLIP_TOKENS = 77


def byte_level_tokenizer():
    """A CLIP tokenizer whose vocabulary is every byte, with no merges, so any prompt encodes."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    pieces = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {piece: i for i, piece in enumerate(pieces + [p + "</w>" for p in pieces])}
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=CLIP_TOKENS)


def char_t5_tokenizer(length: int = 512):
    """A T5 tokenizer (SentencePiece-style unigram) whose pieces are single characters, so any ASCII
    prompt encodes; it saves and loads as T5's own."""
    import string

    from transformers import T5TokenizerFast

    pieces = ["\u2581", *string.ascii_letters, *string.digits, *string.punctuation]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(piece, -1.0) for piece in pieces]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=length)


def clip_text_encoder(tokenizer, width: int, layers: int, heads: int, projection: bool = False,
                      activation: str = "gelu"):
    """A CLIP text encoder for `tokenizer`'s vocabulary (with the projection SDXL's second and SD3's
    encoders have, whose output is the pooled embedding)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=width, intermediate_size=4 * width, num_attention_heads=heads,
        num_hidden_layers=layers, max_position_embeddings=CLIP_TOKENS, projection_dim=width, hidden_act=activation,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return CLIPTextModelWithProjection(config) if projection else CLIPTextModel(config)


def t5_text_encoder(tokenizer, width: int, layers: int, heads: int, head_width: int, feed_forward: int):
    """A T5 encoder (gated GELU, as T5 v1.1 and the T5-XXL of Flux and SD3) for `tokenizer`'s vocabulary."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), d_model=width, d_kv=head_width, d_ff=feed_forward, num_layers=layers,
        num_heads=heads, feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False))


def autoencoder(channels: tuple[int, ...], groups: int, layers: int, latent_channels: int, image_size: int,
                **config):
    """An AutoencoderKL of len(channels) levels (the latent is the image scaled down by
    2 ** (levels - 1)); `config`: the scaling and shift factors, quant convs, force_upcast."""
    from diffusers import AutoencoderKL

    depth = len(channels)
    return AutoencoderKL(block_out_channels=tuple(channels), down_block_types=("DownEncoderBlock2D",) * depth,
                         up_block_types=("UpDecoderBlock2D",) * depth, latent_channels=latent_channels,
                         norm_num_groups=groups, layers_per_block=layers, sample_size=image_size, **config)
