"""The attention layers of a checkpoint that torch_backend.quantized=fp8 converts: diffusers'
attention processors rewritten so that the q/k/v projections that read one input run as one FP8
GEMM, and, where the checkpoint calibrated attention (quant_level=4), attention itself runs as
FP8 (sdquant.kernels.fp8_attention), its FP8 output going into the next FP8 GEMM as it is.

The processors follow diffusers 0.42's own step for step (AttnProcessor2_0 for a UNet's
Attention, FluxAttnProcessor for Flux's joint and single-stream attention): the same reshapes, q/k
norms, rotary embedding, order of the text and image tokens and split of the output. An attention
whose ranges say FP8 quantizes q, k and v where they enter attention with those ranges; the
output is rounded with the input range of the layer that reads it (to_out, or a single block's
proj_out).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .errors import UserError
from .fp8_layers import Fp8Linear
from .kernels.exact import KeepsExactTensors
from .kernels.fp8 import fp8_scales, to_fp8
from .kernels.fp8_attention import fp8_attention
from .shared_ranges import ADDED_QKV, KV, QKV, attention_layers, output_groups, projection_groups

FP8_ATTENTION = "fp8_attention"


class Fp8Attention(KeepsExactTensors, torch.nn.Module):
    """One attention layer's FP8 attention: the ranges of its q, k and v where they enter attention,
    and the input range of the layer that reads its output."""

    exact = ("q_inverse_scale", "q_scale", "k_inverse_scale", "k_scale", "v_inverse_scale", "v_scale",
             "out_inverse_scale", "out_scale")

    def __init__(self, amax: dict[str, torch.Tensor], reader: Fp8Linear):
        super().__init__()
        device = reader.input_scale.device
        for role in ("q", "k", "v"):
            inverse, scale = fp8_scales(amax[role])
            self.register_buffer(f"{role}_inverse_scale", inverse.to(device))
            self.register_buffer(f"{role}_scale", scale.to(device))
        self.register_buffer("out_inverse_scale", reader.input_inverse_scale.clone())
        self.register_buffer("out_scale", reader.input_scale.clone())

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """(batch, heads, tokens, head_dim) q, k and v in the model's precision -> the FP8 output."""
        return fp8_attention(
            to_fp8(query, self.q_inverse_scale), to_fp8(key, self.k_inverse_scale), to_fp8(value, self.v_inverse_scale),
            self.q_scale, self.k_scale, self.v_scale, query.shape[-1] ** -0.5, self.out_inverse_scale)

    def dequantize(self, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """For a reader that takes it in the model's precision: its FP8 input quantizer rounds these
        values back to the very same FP8 ones."""
        return (out.float() * self.out_scale).to(dtype)


def _project(attn, x: torch.Tensor, group: tuple[tuple[str, ...], str]) -> tuple[torch.Tensor, ...]:
    """The group's projections of `x`, by its fused GEMM where the conversion made one."""
    names, fused_name = group
    fused = getattr(attn, fused_name, None)
    if fused is not None:
        return fused(x).chunk(len(names), dim=-1)
    return tuple(getattr(attn, name)(x) for name in names)


def _attend(attn, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """(batch, heads, tokens, head_dim) attention: FP8 where the layer has its ranges, else in the
    model's precision, as diffusers runs it."""
    fp8 = getattr(attn, FP8_ATTENTION, None)
    return F.scaled_dot_product_attention(query, key, value) if fp8 is None else fp8(query, key, value)


def _no_mask(attention_mask) -> None:
    if attention_mask is not None:
        raise ValueError("a converted attention layer takes no attention mask (diffusers' UNets and Flux pass none)")


class UNetAttnProcessor:
    """diffusers' AttnProcessor2_0 for the attention of a UNet's transformer blocks (no group or
    spatial norm, q/k norm, residual or output rescale), on a converted layer."""

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, temb: torch.Tensor | None = None) -> torch.Tensor:
        _no_mask(attention_mask)
        if attn.is_cross_attention:
            context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
            query, (key, value) = attn.to_q(hidden_states), _project(attn, context, KV)
        else:
            query, key, value = _project(attn, hidden_states, QKV)
        query, key, value = (x.unflatten(-1, (attn.heads, -1)).transpose(1, 2) for x in (query, key, value))
        out = _attend(attn, query, key, value).transpose(1, 2).flatten(2)
        return attn.to_out[1](attn.to_out[0](out))


class FluxAttnProcessor:
    """diffusers' FluxAttnProcessor on a converted FluxAttention: a double block's joint attention
    (text tokens first, then the image's; the output split back into the image's through to_out and
    the text's through to_add_out) or a single block's (its output read by the block's proj_out)."""

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        _no_mask(attention_mask)
        query, key, value = (x.unflatten(-1, (-1, attn.head_dim)) for x in _project(attn, hidden_states, QKV))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if attn.added_kv_proj_dim is not None:
            text = (x.unflatten(-1, (-1, attn.head_dim)) for x in _project(attn, encoder_hidden_states, ADDED_QKV))
            text_query, text_key, text_value = text
            text_query, text_key = attn.norm_added_q(text_query), attn.norm_added_k(text_key)
            query, key, value = (torch.cat(pair, dim=1)
                                 for pair in ((text_query, query), (text_key, key), (text_value, value)))
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        out = _attend(attn, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)).transpose(1, 2).flatten(2)
        if encoder_hidden_states is None:
            fp8 = getattr(attn, FP8_ATTENTION, None)
            return out if fp8 is None else fp8.dequantize(out, hidden_states.dtype)
        text_tokens = encoder_hidden_states.shape[1]
        text, image = out.split_with_sizes([text_tokens, out.shape[1] - text_tokens], dim=1)
        image = attn.to_out[1](attn.to_out[0](image.contiguous()))
        return image, attn.to_add_out(text.contiguous())


def _processor_for(attn):
    """Ours in place of diffusers' default processor, or None where the layer runs another one or
    uses a feature ours leave out."""
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0
    from diffusers.models.transformers import transformer_flux

    if isinstance(attn, transformer_flux.FluxAttention):
        return FluxAttnProcessor() if type(attn.processor) is transformer_flux.FluxAttnProcessor else None
    plain = (type(attn.processor) is AttnProcessor2_0 and attn.spatial_norm is None and attn.group_norm is None
             and attn.norm_cross is None and attn.norm_q is None and attn.norm_k is None
             and not attn.residual_connection and attn.rescale_output_factor == 1.0)
    return UNetAttnProcessor() if isinstance(attn, Attention) and plain else None


def _fuse(attn, group: tuple[tuple[str, ...], str]) -> bool:
    """Replaces the group's FP8 layers with one GEMM where their scales allow (see Fp8Linear.stacked)."""
    names, fused_name = group
    layers = [getattr(attn, name) for name in names]
    stacked = Fp8Linear.stacked(layers) if all(isinstance(layer, Fp8Linear) for layer in layers) else None
    if stacked is None:
        return False
    setattr(attn, fused_name, stacked)
    for name in names:
        delattr(attn, name)
    return True


def _output_reader(backbone, name: str, attn) -> Fp8Linear:
    """The FP8 layer whose input range the attention output is rounded with: to_out (which a joint
    attention's to_add_out must share, as quantize.py ties them), or for an attention without one (a
    Flux single block's) its block's proj_out."""
    if isinstance(getattr(attn, "to_out", None), torch.nn.ModuleList):
        readers = [attn.get_submodule(layer) for group in output_groups(attn) for layer in group] or [attn.to_out[0]]
    else:
        readers = [backbone.get_submodule(name.rpartition(".")[0]).proj_out]
    first = readers[0]
    if not all(isinstance(reader, Fp8Linear) and torch.equal(reader.input_scale, first.input_scale) for reader in readers):
        raise UserError(f"{name}: FP8 attention needs the layers reading its output to be FP8 layers sharing one "
                        "input range, which quantize.py ties from this version on: quantize the checkpoint again, or "
                        "set torch_backend.attention=fp16")
    return first


def convert_attention(backbone: torch.nn.Module, ranges: dict[str, dict[str, torch.Tensor]]) -> int:
    """Gives each attention layer of `backbone` (whose Linear layers are already Fp8Linear) its
    fused projections and, where `ranges` names it ({layer: q, k, v amax}), FP8 attention; returns
    how many run FP8 attention."""
    fp8_layers = 0
    for name, attn in attention_layers(backbone):
        processor = _processor_for(attn)
        if processor is None:
            if name in ranges:
                raise UserError(f"{name}: FP8 attention runs diffusers' default attention processors only, and this "
                                f"layer runs {type(attn.processor).__name__}: set torch_backend.attention=fp16")
            continue
        fused = [_fuse(attn, group) for group in projection_groups(attn)]
        if name in ranges:
            attn.add_module(FP8_ATTENTION, Fp8Attention(ranges[name], _output_reader(backbone, name, attn)))
            fp8_layers += 1
        if any(fused) or name in ranges:
            attn.set_processor(processor)
    return fp8_layers
