"""The Flux scene model: its architecture from the training config and its training loss."""

from __future__ import annotations

import torch

from .sizes import FluxSizes
from ..training import autocast, kept


def scene_sizes(arch, image_size: int) -> FluxSizes:
    """The Flux scene model's architecture (config's FluxSceneArchitecture): heads of 32 features in
    both encoders, no guidance embedding, a VAE whose shift and scale training sets."""
    return FluxSizes(
        clip_width=arch.clip_width, clip_layers=arch.text_layers, clip_heads=max(1, arch.clip_width // 32),
        clip_activation="gelu", t5_width=arch.t5_width, t5_layers=arch.text_layers, t5_heads=arch.t5_width // 32,
        t5_head_width=32, t5_ff=2 * arch.t5_width, double_blocks=arch.double_blocks,
        single_blocks=arch.single_blocks, heads=arch.heads, head_dim=arch.head_dim, rope_axes=tuple(arch.rope_axes),
        vae_channels=tuple(arch.vae_channels), vae_groups=arch.norm_groups, vae_layers=arch.vae_layers,
        image_size=image_size, guidance=False, vae_config=(("shift_factor", 0.0), ("force_upcast", False)))


def scene_loss(pipe, latents: torch.Tensor, data, block, generator: torch.Generator):
    """The transformer predicts the velocity (noise minus image) of the straight path from the
    image to noise, at logit-normal noise levels (SD3's default weighting), conditioned on CLIP's
    pooled output and T5's hidden states, with the packed latents and position ids that
    FluxPipeline makes; a dropped caption is the empty one, what diffusers' true CFG feeds."""
    import torch.nn.functional as F
    from diffusers import FluxPipeline

    device = latents.device
    channels, height, width = latents.shape[1:]
    image_ids = FluxPipeline._prepare_latent_image_ids(block.batch_size, height // 2, width // 2, device,
                                                        torch.float32)
    text_ids = torch.zeros(data.token_ids["t5"].shape[1], 3, device=device)

    def packed(tensor: torch.Tensor) -> torch.Tensor:
        return FluxPipeline._pack_latents(tensor, len(tensor), channels, height, width)

    def loss_of(indices: torch.Tensor) -> torch.Tensor:
        clean = latents[indices]
        noise = torch.randn(clean.shape, device=device, generator=generator)
        sigma = torch.sigmoid(torch.randn(len(indices), device=device, generator=generator))
        noisy = clean + sigma[:, None, None, None] * (noise - clean)
        keep = kept(block, generator, device)[:, None]
        clip_ids = torch.where(keep, data.token_ids["clip"][indices], data.empty_ids["clip"])
        t5_ids = torch.where(keep, data.token_ids["t5"][indices], data.empty_ids["t5"])
        with autocast(device):
            velocity = pipe.transformer(
                hidden_states=packed(noisy), encoder_hidden_states=pipe.text_encoder_2(t5_ids).last_hidden_state,
                pooled_projections=pipe.text_encoder(clip_ids).pooler_output, timestep=sigma, img_ids=image_ids,
                txt_ids=text_ids, return_dict=False)[0]
        return F.mse_loss(velocity.float(), packed(noise - clean))

    return loss_of
