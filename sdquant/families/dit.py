"""What the diffusion transformers Flux.1 and SD3.5 share: the flow-matching shift of their noise
levels for an image's token count, T5's sequence at their model's own length, and their AdaLN
norms."""

from __future__ import annotations


def calculate_shift(image_tokens: int, config) -> float:
    """The flow-matching shift `mu` for an image of this many packed tokens: linear between the
    scheduler's (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift), as diffusers
    computes it."""
    base_tokens, max_tokens = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    base_shift, max_shift = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
    slope = (max_shift - base_shift) / (max_tokens - base_tokens)
    return image_tokens * slope + base_shift - slope * base_tokens


def text_tokens(t5_tokenizer, pipeline_tokens: int) -> int:
    """T5's sequence length for a model: its tokenizer's own length up to its diffusers pipeline's
    `pipeline_tokens`, so a model trained on short captions (the Flux scene model's 32) runs at the
    length it learned."""
    return min(pipeline_tokens, int(t5_tokenizer.model_max_length))


class OwnT5Length:
    """What a family whose T5 reads its model's own sequence (text_tokens) gives a call of the
    diffusers pipeline and records of its export, for the engines' profiles."""

    # The pipeline's T5 tokenizer, and the sequence its diffusers pipeline defaults to.
    t5_tokenizer: str
    t5_tokens: int

    def t5_length(self, pipe) -> int:
        return text_tokens(getattr(pipe, self.t5_tokenizer), self.t5_tokens)

    def pipeline_call_kwargs(self, pipe) -> dict:
        return {"max_sequence_length": self.t5_length(pipe)}

    def export_sizes(self, pipe, geometry) -> dict:
        return {"text_tokens": self.t5_length(pipe)}


def adaln_norms() -> tuple[type, ...]:
    """diffusers' AdaLN norms of the Flux and SD3 transformers, each mapping the embedding it is given
    as linear(silu(emb)), whose maps the compiled torch backend precomputes for every step
    (sdquant.runtime.step_modulations)."""
    from diffusers.models.normalization import (AdaLayerNormContinuous, AdaLayerNormZero, AdaLayerNormZeroSingle,
                                                SD35AdaLayerNormZeroX)

    return AdaLayerNormZero, AdaLayerNormZeroSingle, AdaLayerNormContinuous, SD35AdaLayerNormZeroX
