"""The UNet as a graph with NeMo's names and inputs (x, timesteps, context and, for SDXL, y), the sizes
of its axes, and the attention processor that runs its attention in FP8."""

from __future__ import annotations

import contextlib
import types

import torch

from ..base import KV, QKV
from .deep_cache import deep_sizes
from ...graphs.networks import BATCH, CONTEXT, HEIGHT, LATENT, TOKENS, WIDTH, Network, Role


def unet_network(name: str, pooled_input: bool) -> Network:
    """x, timesteps, context and (SDXL) y, NeMo's pooled text embedding joined to the Fourier-embedded
    time ids -> the noise prediction."""
    inputs = {"x": LATENT, "timesteps": {0: BATCH}, "context": {0: BATCH, 1: CONTEXT}}
    if pooled_input:
        inputs["y"] = {0: BATCH}
    return Network(name, inputs, {"out": LATENT}, role=Role.backbone, guided=True, kept_precision=("timesteps",))


class UNetGraph(torch.nn.Module):
    """The UNet with NeMo's inputs: x, timesteps, context, and for SDXL y (the add-embedding's input)."""

    # The Fourier time embedding builds its frequencies with arange on the timesteps' device: on
    # the meta device they would have no values, so for a meta trace the timesteps stay on the CPU
    # and only their embedding moves to meta.
    host_inputs = ("timesteps",)

    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def host_modules(self) -> list[torch.nn.Module]:
        return [self.unet.time_proj]

    def forward(self, x, timesteps, context, y=None):
        if y is None:
            return self.unet(x, timesteps, encoder_hidden_states=context, return_dict=False)[0]
        with y_conditioning(self.unet):
            return self.unet(x, timesteps, encoder_hidden_states=context, added_cond_kwargs={"y": y},
                             return_dict=False)[0]


@contextlib.contextmanager
def y_conditioning(unet):
    """Makes the SDXL UNet take ``y`` as its add_embedding input, as NeMo's graph does."""

    def aug_embed_from_y(self, emb, encoder_hidden_states, added_cond_kwargs):
        return self.add_embedding(added_cond_kwargs["y"].to(emb.dtype))

    unet.get_aug_embed = types.MethodType(aug_embed_from_y, unet)
    try:
        yield unet
    finally:
        del unet.get_aug_embed


def unet_axis_sizes(latent_height: int, latent_width: int, windows: int, branch: int | None) -> dict[str, int]:
    """The UNet graphs' axes: the latent's sides, the context's CLIP windows and, for a cached
    pass, its feature's sides."""
    deep = {} if branch is None else deep_sizes(latent_height, latent_width, branch)
    return {HEIGHT: latent_height, WIDTH: latent_width, CONTEXT: windows * TOKENS, **deep}


class UNetFp8AttnProcessor:
    """diffusers' AttnProcessor2_0 for the attention of a UNet's transformer blocks (no group or
    spatial norm, q/k norm, residual or output rescale) on a layer the torch backend converted to
    FP8: fused projections, and FP8 attention where the layer has its ranges."""

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, temb: torch.Tensor | None = None) -> torch.Tensor:
        from ...runtime.attention import attend, no_mask, project

        no_mask(attention_mask)
        if attn.is_cross_attention:
            context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
            query, (key, value) = attn.to_q(hidden_states), project(attn, context, KV)
        else:
            query, key, value = project(attn, hidden_states, QKV)
        out = attend(attn, *(x.unflatten(-1, (attn.heads, -1)) for x in (query, key, value)))
        return attn.to_out[1](attn.to_out[0](out))
