"""Flux's networks as graphs: clip (pooled embedding), t5 (hidden states), transformer, the torch
backend's stage of every step's AdaLN modulations, the attention processor that runs its attention
in FP8, and the rotary embedding's halves order the compiled torch backend gives the transformer.

The transformer's graph takes diffusers' own inputs: hidden_states (B, L, 64) packed latents,
encoder_hidden_states (B, T, 4096), pooled_projections (B, 768), timestep (B,) in 0..1, img_ids
(L, 3), txt_ids (T, 3) and, for models with the guidance embedding (dev), guidance (B,); it gives
the velocity `latent` (B, L, 64). L, the image's packed tokens, and T, T5's tokens, are dynamic,
as is the batch.
"""

from __future__ import annotations

import contextlib

import torch

from ..base import ADDED_QKV, QKV
from ..encoders import clip_network, t5_network
from ...graphs.networks import BATCH, TEXT_TOKENS, Network, Role
from ...runtime.step_modulations import MODULATIONS

# The transformer's packed image tokens: one per 2x2 latent patch.
IMAGE_TOKENS = "L"


def transformer_network(guidance: bool) -> Network:
    inputs = {"hidden_states": {0: BATCH, 1: IMAGE_TOKENS}, "encoder_hidden_states": {0: BATCH, 1: TEXT_TOKENS},
              "pooled_projections": {0: BATCH}, "timestep": {0: BATCH}, "img_ids": {0: IMAGE_TOKENS},
              "txt_ids": {0: TEXT_TOKENS}}
    if guidance:
        inputs["guidance"] = {0: BATCH}
    # A transformer without the guidance embedding (Flux.1-schnell's, the scene model's) is exported
    # without that input.
    return Network("transformer", inputs, {"latent": {0: BATCH, 1: IMAGE_TOKENS}}, role=Role.backbone,
                   optional=("guidance",))


def modulations_network(guidance: bool) -> Network:
    """The torch backend's stage of every step's AdaLN modulations (sdquant.runtime.step_modulations):
    each row of the embedding's inputs, all of a generation's steps at once, to its modulations."""
    inputs = {"pooled_projections": {0: BATCH}, "timestep": {0: BATCH}}
    if guidance:
        inputs["guidance"] = {0: BATCH}
    return Network(MODULATIONS, inputs, {MODULATIONS: {0: BATCH}})


CLIP = clip_network("clip", hidden=False, pooled=True)
T5 = t5_network()


def _rotated(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], sequence_dim: int = 2,
             **_) -> torch.Tensor:
    """Flux's rotary embedding of q or k (pairs of neighbouring features rotated by the position's
    angles), with the pairs split by unflatten: diffusers' reshape to x.shape[:-1] records the
    traced sequence length as a constant, which would pin the graph to one image size."""
    cos, sin = _broadcast_tables(cos_sin, sequence_dim, x.device)
    real, imag = x.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(-2)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def _broadcast_tables(cos_sin: tuple[torch.Tensor, torch.Tensor], sequence_dim: int, device) -> list[torch.Tensor]:
    """The rotary tables (tokens, head_dim) shaped to multiply q or k, whose tokens are dimension
    `sequence_dim` (1: batch, tokens, heads; 2: batch, heads, tokens), as diffusers' apply_rotary_emb takes them."""
    index = (None, slice(None), None, slice(None)) if sequence_dim == 1 else (None, None, slice(None), slice(None))
    return [table[index].to(device) for table in cos_sin]


class TransformerGraph(torch.nn.Module):
    # The timestep and guidance Fourier features and the rotary embedding of the position ids
    # build their frequencies with arange on their inputs' device: for a meta trace those inputs
    # stay on the CPU and only the embeddings move to meta (as the UNet's timesteps do).
    host_inputs = ("timestep", "img_ids", "txt_ids", "guidance")

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def host_modules(self) -> list[torch.nn.Module]:
        return [self.transformer.time_text_embed.time_proj, self.transformer.pos_embed]

    @contextlib.contextmanager
    def traceable(self):
        """For the ONNX trace: the rotary embedding and the split of the joint sequence written
        so that the image and text token counts stay dynamic."""
        from diffusers.models.transformers import transformer_flux

        rotary = transformer_flux.apply_rotary_emb
        transformer_flux.apply_rotary_emb = _rotated
        try:
            yield
        finally:
            transformer_flux.apply_rotary_emb = rotary

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
                guidance=None):
        return self.transformer(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                                pooled_projections=pooled_projections, timestep=timestep, img_ids=img_ids,
                                txt_ids=txt_ids, guidance=guidance, return_dict=False)[0]


def model_dtype(transformer) -> torch.dtype:
    """The precision the transformer's forward computes in: its embedded image tokens' (the first
    parameter may be an FP8 layer's)."""
    return transformer.x_embedder.weight.dtype


class ModulationsGraph(torch.nn.Module):
    """Every AdaLN modulation of a transformer whose modulations are precomputed, for rows of its
    embedding's inputs: the pooled text, the timestep in 0..1 and the guidance, scaled by 1000 in
    the model's precision as the transformer's forward scales them."""

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def forward(self, pooled_projections, timestep, guidance=None):
        dtype = model_dtype(self.transformer)
        scaled = [timestep.to(dtype) * 1000] + ([] if guidance is None else [guidance.to(dtype) * 1000])
        return self.transformer.time_text_embed.rows(*scaled, pooled_projections)


class FluxTorchAttnProcessor:
    """diffusers' FluxAttnProcessor over the torch backend's forms of a FluxAttention: a double
    block's joint attention (text tokens first, then the image's; the output split back into the
    image's through to_out and the text's through to_add_out) or a single block's (its output read by
    the block's proj_out), over fused projections and FP8 attention where the layer has its ranges.
    With `rotary_halves`, q's and k's head features come ordered as `use_rotary_halves` leaves them."""

    def __init__(self, rotary_halves: bool = False):
        self.rotary_halves = rotary_halves

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        from ...runtime.attention import FP8_ATTENTION, attend, no_mask, project

        no_mask(attention_mask)
        query, key, value = (x.unflatten(-1, (-1, attn.head_dim)) for x in project(attn, hidden_states, QKV))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if attn.added_kv_proj_dim is not None:
            text = (x.unflatten(-1, (-1, attn.head_dim)) for x in project(attn, encoder_hidden_states, ADDED_QKV))
            text_query, text_key, text_value = text
            text_query, text_key = attn.norm_added_q(text_query), attn.norm_added_k(text_key)
            query, key, value = (torch.cat(pair, dim=1)
                                 for pair in ((text_query, query), (text_key, key), (text_value, value)))
        if image_rotary_emb is not None:
            rotate = _rotated_halves if self.rotary_halves else apply_rotary_emb
            query = rotate(query, image_rotary_emb, sequence_dim=1)
            key = rotate(key, image_rotary_emb, sequence_dim=1)
        out = attend(attn, query, key, value)
        if encoder_hidden_states is None:
            fp8 = getattr(attn, FP8_ATTENTION, None)
            return out if fp8 is None else fp8.dequantize(out, hidden_states.dtype)
        text_tokens = encoder_hidden_states.shape[1]
        text, image = out.split_with_sizes([text_tokens, out.shape[1] - text_tokens], dim=1)
        image = attn.to_out[1](attn.to_out[0](image.contiguous()))
        return image, attn.to_add_out(text.contiguous())


def _evens_then_odds(features: int) -> torch.Tensor:
    return torch.cat([torch.arange(0, features, 2), torch.arange(1, features, 2)])


def _tables_in_halves_order(pos_embed, args, tables):
    """The rotary embedding's cos and sin tables with each pair's two columns half a head apart."""
    return tuple(torch.cat([table[..., 0::2], table[..., 1::2]], dim=-1) for table in tables)


def _rotated_halves(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], sequence_dim: int = 2) -> torch.Tensor:
    """Flux's rotary embedding of q or k whose head features are ordered evens then odds, with its
    tables ordered alike: pair i is features i and i + head_dim / 2. Each output is the very sum
    diffusers' apply_rotary_emb forms for it."""
    cos, sin = _broadcast_tables(cos_sin, sequence_dim, x.device)
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def use_rotary_halves(transformer) -> bool:
    """Orders every head's q and k features evens then odds in `transformer`, in place: the rows of
    its q and k projections (fused or not), its q/k norms' weights and the rotary tables. Each head's
    q.k, and so the model's output, stays as it was; but the rotary embedding then rotates pairs half
    a head apart, which the compiler fuses with the q/k norms into a kernel reading each half
    contiguously, where diffusers' neighbouring pairs made a two-pass kernel with four masked loads a
    value (Flux.1-dev's q/k norm+RoPE+FP8 cast, 4608 tokens: 0.085 -> 0.067 ms a call on an H200,
    benchmarks/results/flux_kernel_forms_h200.json). All or nothing, as every attention reads the
    one table: False, with nothing changed, where a layer runs another processor (an IP-Adapter's)
    or a projection of a class the reorder does not know (fake quantization), and where the
    transformer is in this order already (reordering twice would pair other features)."""
    from diffusers.models.transformers.transformer_flux import FluxAttention, FluxAttnProcessor

    from ...runtime.compiled_forms import OUTPUT_ROWS, reorder_outputs

    if _tables_in_halves_order in transformer.pos_embed._forward_hooks.values():
        return False
    layers = [module for module in transformer.modules() if isinstance(module, FluxAttention)]
    projections = {id(attn): [(getattr(attn, name), name == fused) for names, fused in (QKV, ADDED_QKV)
                              for name in (*names[:2], fused) if isinstance(getattr(attn, name, None), torch.nn.Module)]
                   for attn in layers}
    convertible = all(type(attn.processor) in (FluxAttnProcessor, FluxTorchAttnProcessor)
                      and not getattr(attn.processor, "rotary_halves", False)
                      and all(type(layer) in OUTPUT_ROWS for layer, _ in projections[id(attn)]) for attn in layers)
    if not layers or not convertible:
        return False
    for attn in layers:
        head_order = _evens_then_odds(attn.head_dim)
        order = (torch.arange(attn.heads)[:, None] * attn.head_dim + head_order).flatten()
        for layer, fused in projections[id(attn)]:
            # A fused layer's rows are q's, k's and v's: v keeps its order.
            inner = len(order)
            rows = torch.cat([order, order + inner, torch.arange(2 * inner, 3 * inner)]) if fused else order
            reorder_outputs(layer, rows)
        norms = (attn.norm_q, attn.norm_k, getattr(attn, "norm_added_q", None), getattr(attn, "norm_added_k", None))
        for norm in norms:
            if getattr(norm, "weight", None) is not None:
                norm.weight.data = norm.weight.data[head_order.to(norm.weight.device)]
        attn.set_processor(FluxTorchAttnProcessor(rotary_halves=True))
    transformer.pos_embed.register_forward_hook(_tables_in_halves_order)
    return True
