"""Wan2.2's networks as graphs: umt5 (the prompt's hidden states, zero past its length as
WanPipeline pads them), each expert (transformer, transformer_2: the video latent, the timestep and
the text to the flow's velocity) and vae (the latent, denormalized inside the graph, to the frames).

The experts' rotary tables, the unpatchify and the VAE's causal decode, one latent frame at a time
with its feature cache, take their sizes from the input's shape as Python integers, which the ONNX
trace keeps as constants: these graphs run at the geometry they were traced at (the engines' own:
export_trt.py's infer.num_frames, height and width, and batch), and a graph of another geometry is
exported as another graph.
"""

from __future__ import annotations

import contextlib

import torch

from ..base import KV, QKV
from ...graphs.networks import BATCH, TEXT_TOKENS, VIDEO_LATENT, Network, Role

# A model that expands its timestep takes one per latent token of its 2x2 patches.
LATENT_TOKENS = "N"
TEXT = {0: BATCH, 1: TEXT_TOKENS}
UMT5 = Network("umt5", {"input_ids": TEXT, "attention_mask": TEXT}, {"hidden_states": TEXT}, guided=True, fixed=True)
VIDEO_VAE = Network("vae", {"latent": VIDEO_LATENT}, {"video": {0: BATCH}}, role=Role.decoder, fixed=True)


def expert_network(graph: str) -> Network:
    """hidden_states (B, C, F, H, W) latents, timestep (B,) (or per token, for a model that expands
    it) and encoder_hidden_states (B, T, text width) -> the velocity `latent`, of the latents' shape.
    The timestep keeps fp32: bf16 would round t near 1000 by up to 4."""
    return Network(graph, {"hidden_states": VIDEO_LATENT, "timestep": {0: BATCH, 1: LATENT_TOKENS},
                           "encoder_hidden_states": TEXT}, {"latent": VIDEO_LATENT},
                   role=Role.backbone, guided=True, kept_precision=("timestep",), fixed=True)


class Umt5Graph(torch.nn.Module):
    """input_ids, attention_mask -> UMT5's last hidden states, zero past each prompt's length."""

    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids, attention_mask):
        hidden = self.encoder(input_ids, attention_mask).last_hidden_state
        return hidden * attention_mask[..., None].to(hidden.dtype)


class ExpertGraph(torch.nn.Module):
    """One Wan expert with its graph's inputs."""

    # The timestep's Fourier features build their frequencies with arange on the timestep's device,
    # and the rotary tables are buffers the positions index: for a meta trace both stay on the host
    # and only what they give moves to meta.
    host_inputs = ("timestep",)

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def host_modules(self) -> list[torch.nn.Module]:
        return [self.transformer.condition_embedder.timesteps_proj, self.transformer.rope]

    def forward(self, hidden_states, timestep, encoder_hidden_states):
        return self.transformer(hidden_states=hidden_states, timestep=timestep,
                                encoder_hidden_states=encoder_hidden_states, return_dict=False)[0]


class VideoDecoderGraph(torch.nn.Module):
    """latent (B, C, F, h, w) -> video (B, 3, F', H, W) in [-1, 1], the latent denormalized with the
    VAE's per-channel mean and std as WanPipeline does (dividing by the reciprocal of the std, as it
    does, so that the same latents give the same bits)."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, latent):
        config = self.vae.config
        shape = (1, config.z_dim, 1, 1, 1)
        mean = torch.tensor(config.latents_mean).view(shape).to(latent.device, latent.dtype)
        inverse_std = 1.0 / torch.tensor(config.latents_std).view(shape).to(latent.device, latent.dtype)
        return self.vae.decode(latent / inverse_std + mean, return_dict=False)[0]

    @contextlib.contextmanager
    def traceable(self):
        """For the ONNX trace: the VAE's 2x nearest-exact upsampling as plain nearest, which is the
        same at an integer factor and which the exporter knows."""
        from diffusers.models.autoencoders.autoencoder_kl_wan import WanUpsample

        upsamplers = [module for module in self.vae.modules() if isinstance(module, WanUpsample)]
        modes = [module.mode for module in upsamplers]
        for module in upsamplers:
            module.mode = "nearest"
        try:
            yield
        finally:
            for module, mode in zip(upsamplers, modes):
                module.mode = mode


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding of q or k (B, tokens, heads, head_dim): neighbouring features rotated
    by each position's angles, in the very operations of diffusers' WanAttnProcessor."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class WanTorchAttnProcessor:
    """diffusers' WanAttnProcessor (text-to-video: no image context) on a layer the torch backend
    converted to FP8: its projections fused where they read one input, q/k norms over the heads,
    the rotary embedding on self-attention, and FP8 attention where the layer has its ranges, whose
    FP8 output to_out reads as it is."""

    # The process group its tokens are split over, where parallel.ulysses splits them.
    sequence_group = None

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb=None) -> torch.Tensor:
        from ...runtime.attention import attend, no_mask, project

        no_mask(attention_mask)
        if attn.is_cross_attention:
            query, (key, value) = attn.to_q(hidden_states), project(attn, encoder_hidden_states, KV)
        else:
            query, key, value = project(attn, hidden_states, QKV)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, value))
        if rotary_emb is not None:
            query, key = _rotated(query, *rotary_emb), _rotated(key, *rotary_emb)
        out = attend(attn, query, key, value, self.sequence_group, keys_whole=attn.is_cross_attention)
        return attn.to_out[1](attn.to_out[0](out if out.dtype != query.dtype else out.type_as(query)))
