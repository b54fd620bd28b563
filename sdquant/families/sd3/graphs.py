"""SD3.5's networks as graphs: clip_l and clip_g (penultimate hidden states and pooled projection),
t5 (hidden states), the MMDiT transformer, the torch backend's stage of every step's AdaLN
modulations, and the attention processor that runs its attention in FP8.

The transformer's graph takes diffusers' own inputs: hidden_states (B, 16, h, w) latents,
encoder_hidden_states (B, 77 + T, 4096) (both CLIP encoders' hidden states side by side, padded to
T5's width, then T5's), pooled_projections (B, 2048) (both CLIP projections) and timestep (B,) on
the scheduler's 0..1000 scale, in fp32 as the pipeline hands it; it gives the velocity `latent`
(B, 16, h, w). The batch, the latent's sides, T5's tokens and so the joint text axis are dynamic.
"""

from __future__ import annotations

import dataclasses

import torch

from ..base import ADDED_QKV, QKV
from ..encoders import clip_network, t5_network
from ...graphs.networks import BATCH, LATENT, VAE, Network, Role
from ...runtime.step_modulations import MODULATIONS

# The transformer's text axis: CLIP's window, then T5's tokens.
JOINT_TOKENS = "J"

CLIP_L = dataclasses.replace(clip_network("clip_l", pooled=True), guided=True)
CLIP_G = dataclasses.replace(clip_network("clip_g", pooled=True), guided=True)
T5 = dataclasses.replace(t5_network(), guided=True)
TRANSFORMER = Network(
    "transformer", {"hidden_states": LATENT, "encoder_hidden_states": {0: BATCH, 1: JOINT_TOKENS},
                    "pooled_projections": {0: BATCH}, "timestep": {0: BATCH}},
    {"latent": LATENT}, role=Role.backbone, guided=True, kept_precision=("timestep",))
NETWORKS = (CLIP_L, CLIP_G, T5, VAE, TRANSFORMER)
# The torch backend's stage of every step's AdaLN modulations (sdquant.runtime.step_modulations):
# each row of the embedding's inputs, all of a generation's steps at once, to its modulations.
MODULATIONS_NETWORK = Network(MODULATIONS, {"pooled_projections": {0: BATCH}, "timestep": {0: BATCH}},
                              {MODULATIONS: {0: BATCH}}, kept_precision=("timestep",))


class TransformerGraph(torch.nn.Module):
    """SD3Transformer2DModel with diffusers' inputs, the timestep in fp32 as the pipeline hands it
    over (TRANSFORMER.kept_precision).

    It traces with the latent's sides dynamic as it is: the crop of PatchEmbed's position grid and
    the unpatchifying reshape compute from the input's shape, which the tracer records as shape
    ops (the graph equals torch at latent sizes other than the traced one)."""

    # The timestep's Fourier features build their frequencies with arange on the timestep's device:
    # for a meta trace it stays on the CPU and only its embedding moves to meta.
    host_inputs = ("timestep",)

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def host_modules(self) -> list[torch.nn.Module]:
        return [self.transformer.time_text_embed.time_proj]

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep):
        return self.transformer(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                                pooled_projections=pooled_projections, timestep=timestep, return_dict=False)[0]


class ModulationsGraph(torch.nn.Module):
    """Every AdaLN modulation of a transformer whose modulations are precomputed, for rows of its
    embedding's inputs: the pooled text and the timestep, as the transformer's forward hands them on."""

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def forward(self, pooled_projections, timestep):
        return self.transformer.time_text_embed.rows(timestep, pooled_projections)


class SD3TorchAttnProcessor:
    """diffusers' JointAttnProcessor2_0 on an attention layer as the torch backend runs it (converted
    to FP8, or 16-bit with fused projections when compiled): a joint attention (the image's tokens
    first, then the text's; the output split back into the image's through to_out and the text's
    through to_add_out, which the last block has none of) or SD3.5-medium's image-only attn2, over
    fused projections and FP8 attention where the layer has its ranges."""

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, *args, **kwargs):
        from ...runtime.attention import attend, no_mask, project

        no_mask(attention_mask)
        query, key, value = _per_head(attn, project(attn, hidden_states, QKV), attn.norm_q, attn.norm_k)
        if encoder_hidden_states is not None:
            text = _per_head(attn, project(attn, encoder_hidden_states, ADDED_QKV), attn.norm_added_q,
                             attn.norm_added_k)
            query, key, value = (torch.cat(pair, dim=1) for pair in zip((query, key, value), text))
        out = attend(attn, query, key, value)
        image_tokens = hidden_states.shape[1]
        image = attn.to_out[1](attn.to_out[0](out[:, :image_tokens].contiguous()))
        if encoder_hidden_states is None:
            return image
        text = out[:, image_tokens:]
        # The last block's text stream ends here: its block reads no text output.
        return image, text if attn.to_add_out is None else attn.to_add_out(text.contiguous())


def _per_head(attn, projections, norm_q, norm_k) -> tuple[torch.Tensor, ...]:
    """q, k and v as (batch, tokens, heads, head_dim), q and k normed where the layer norms them."""
    query, key, value = (x.unflatten(-1, (attn.heads, -1)) for x in projections)
    return (query if norm_q is None else norm_q(query)), (key if norm_k is None else norm_k(key)), value
