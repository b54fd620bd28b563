"""The Flux scene model: its training schema (tools/train_scene_model.py --config-name
train_scene_flux), its architecture from it and its training loss."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ...config import DenoiserTraining, SceneTrainingApp, Settled
from ...errors import UserError
from .sizes import FluxSizes
from ..training import autocast, check_group_widths, kept


@dataclass
class FluxSceneArchitecture(Settled):
    """Sizes of the Flux scene model: a FluxTransformer2DModel of heads x head_dim width, CLIP and
    T5 encoders, a 16-channel AutoencoderKL whose widths divide by norm_groups."""

    heads: int = 5
    head_dim: int = 32
    # Rotary axes (a text-position axis and the image's two), summing to head_dim, as Flux.1's 16/56/56.
    rope_axes: list[int] = field(default_factory=lambda: [8, 12, 12])
    double_blocks: int = 4
    single_blocks: int = 8
    clip_width: int = 64
    t5_width: int = 128
    text_layers: int = 2
    vae_channels: list[int] = field(default_factory=lambda: [32, 64, 64])
    vae_layers: int = 2
    norm_groups: int = 32

    def sizes(self, image_size: int) -> FluxSizes:
        """These sizes as the family's for `image_size`: heads of 32 features in both encoders, no
        guidance embedding, a VAE whose shift and scale training sets."""
        return FluxSizes(
            clip_width=self.clip_width, clip_layers=self.text_layers, clip_heads=max(1, self.clip_width // 32),
            clip_activation="gelu", t5_width=self.t5_width, t5_layers=self.text_layers, t5_heads=self.t5_width // 32,
            t5_head_width=32, t5_ff=2 * self.t5_width, double_blocks=self.double_blocks,
            single_blocks=self.single_blocks, heads=self.heads, head_dim=self.head_dim, rope_axes=tuple(self.rope_axes),
            vae_channels=tuple(self.vae_channels), vae_groups=self.norm_groups, vae_layers=self.vae_layers,
            image_size=image_size, guidance=False, vae_config=(("shift_factor", 0.0), ("force_upcast", False)))


@dataclass
class TrainFluxSceneApp(SceneTrainingApp):
    """The built-in Flux scene model (tools/train_scene_model.py --config-name train_scene_flux)."""

    config_name: ClassVar[str] = "train_scene_flux"
    # Its encoders' tokenizers, by kind.
    tokenizers: ClassVar[tuple[str, ...]] = ("clip", "t5")
    out_dir: str = "scenes_flux"
    family: str = "flux"
    architecture: FluxSceneArchitecture = field(default_factory=FluxSceneArchitecture)
    # The shipped run's: twice the UNet's steps, and no captions dropped (Flux.1-dev distils guidance
    # into an embedding, which the scene model has nothing to distil into, so it samples unguided).
    denoiser: DenoiserTraining = field(default_factory=lambda: DenoiserTraining(steps=9000, empty_caption_rate=0.0))
    guidance_scale: float = 1.0

    def check(self) -> None:
        """Refuses, naming the key, sizes the architecture cannot be built with."""
        arch = self.architecture
        check_group_widths(arch, "vae_channels")
        if sum(arch.rope_axes) != arch.head_dim or any(axis % 2 for axis in arch.rope_axes):
            raise UserError(f"architecture.rope_axes={list(arch.rope_axes)}: give even sizes that sum to "
                            f"architecture.head_dim={arch.head_dim}")


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
