"""The SDXL scene model: its training schema (tools/train_scene_model.py, conf/train_scene_model.yaml),
its architecture from it and its training loss."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ...config import SceneTrainingApp, Settled
from ...errors import UserError
from .sizes import UNetSizes
from ..training import autocast, check_group_widths, kept


# The scene model's text-time embedding width: six time ids of 8 Fourier features each.
SCENE_TIME_ID_WIDTH = 8


@dataclass
class SdxlSceneArchitecture(Settled):
    """Widths of the SDXL scene model; every UNet and VAE width must divide by norm_groups (32)."""

    unet_channels: list[int] = field(default_factory=lambda: [64, 96, 128])
    text_widths: list[int] = field(default_factory=lambda: [64, 128])
    text_layers: int = 3
    vae_channels: list[int] = field(default_factory=lambda: [32, 64, 64])
    vae_layers: int = 2
    norm_groups: int = 32

    def sizes(self, image_size: int) -> UNetSizes:
        """These widths as the family's sizes for `image_size`: SDXL's layout, heads of 32 features,
        one transformer layer per attention block; its VAE's scaling is set by training."""
        channels = tuple(self.unet_channels)
        return UNetSizes(
            text_widths=tuple(self.text_widths), text_layers=(self.text_layers,) * 2,
            text_heads=tuple(max(1, width // 32) for width in self.text_widths), unet_channels=channels,
            unet_down=("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (len(channels) - 1),
            unet_up=("CrossAttnUpBlock2D",) * (len(channels) - 1) + ("UpBlock2D",), unet_transformer_layers=1,
            unet_head_dims=tuple(width // 32 for width in channels), unet_groups=self.norm_groups,
            time_id_width=SCENE_TIME_ID_WIDTH, vae_channels=tuple(self.vae_channels), vae_groups=self.norm_groups,
            vae_layers=self.vae_layers, image_size=image_size, vae_config=(("force_upcast", False),))


@dataclass
class TrainSdxlSceneApp(SceneTrainingApp):
    """The built-in SDXL scene model, trained from scratch (tools/train_scene_model.py)."""

    config_name: ClassVar[str] = "train_scene_model"
    # Its encoders' tokenizers, by kind: one CLIP tokenizer serves both.
    tokenizers: ClassVar[tuple[str, ...]] = ("clip",)
    out_dir: str = "scenes_sdxl"
    family: str = "sdxl"
    architecture: SdxlSceneArchitecture = field(default_factory=SdxlSceneArchitecture)

    def check(self) -> None:
        """Refuses, naming the key, widths the architecture cannot be built with."""
        arch = self.architecture
        check_group_widths(arch, "unet_channels", "vae_channels")
        if len(arch.text_widths) != 2 or any(width < 32 or width % 32 for width in arch.text_widths):
            raise UserError(f"architecture.text_widths={list(arch.text_widths)}: give two multiples of 32")

def scene_loss(pipe, latents: torch.Tensor, data, block, generator: torch.Generator):
    """The UNet predicts the noise added under SDXL's DDPM schedule, conditioned on both
    encoders' penultimate hidden states side by side and the second's projected pooled output;
    a dropped caption is zeros, what the pipeline feeds for an empty negative prompt."""
    import torch.nn.functional as F
    from diffusers import DDPMScheduler

    device = latents.device
    noise_schedule = DDPMScheduler.from_config(pipe.scheduler.config)
    size = pipe.vae.config.sample_size
    time_ids = torch.tensor([[size, size, 0, 0, size, size]], dtype=torch.float32, device=device)

    def loss_of(indices: torch.Tensor) -> torch.Tensor:
        clean = latents[indices]
        noise = torch.randn(clean.shape, device=device, generator=generator)
        timesteps = torch.randint(noise_schedule.config.num_train_timesteps, (len(indices),), device=device,
                                  generator=generator)
        keep = kept(block, generator, device).float()
        token_ids = data.token_ids["clip"][indices]
        with autocast(device):
            first = pipe.text_encoder(token_ids, output_hidden_states=True)
            second = pipe.text_encoder_2(token_ids, output_hidden_states=True)
            context = torch.cat([first.hidden_states[-2], second.hidden_states[-2]], dim=-1)
            prediction = pipe.unet(noise_schedule.add_noise(clean, noise, timesteps), timesteps,
                                   context * keep[:, None, None],
                                   added_cond_kwargs={"text_embeds": second.text_embeds * keep[:, None],
                                                      "time_ids": time_ids.expand(len(indices), -1)}).sample
        return F.mse_loss(prediction.float(), noise)

    return loss_of
