"""SDXL: NeMo's graphs clip1, clip2, unet_xl and vae (the UNet takes x, timesteps, context and y),
the data flow of diffusers' StableDiffusionXLPipeline over them, its architectures and the scene
model's training loss. The UNet, its levels and DeepCache are Stable Diffusion's (sdquant.families.sd).
"""

from __future__ import annotations

import dataclasses

import torch

from . import components
from .base import SEED, Backbone
from .encoders import ClipGraph, clip_network
from ..graphs.networks import Network
from .pipeline import SamplingSettings
from .sd import SDTextToImage, StableDiffusionFamily, UNetSizes, build_unet, sd_scheduler, unet_vae


def sdxl_y(add_time_proj, pooled: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """NeMo's ``y``: the pooled text embedding joined to the Fourier features of SDXL's time ids
    (original size, crop corner, target size), as the UNet's add-embedding takes them."""
    time_ids = torch.tensor([[height, width, 0, 0, height, width]], dtype=torch.float32,
                            device=pooled.device).repeat(pooled.shape[0], 1)
    fourier = add_time_proj(time_ids.flatten()).reshape(pooled.shape[0], -1)
    return torch.cat([pooled, fourier.to(pooled.dtype)], dim=-1)


class SDXLTextToImage(SDTextToImage):
    """SDXL's data flow over stages: SD's, with both CLIP encoders side by side (clip2 also gives
    the pooled embedding), NeMo's y and SDXL's empty negative prompt as zeros; mirrors diffusers'
    StableDiffusionXLPipeline image for image."""

    def __init__(self, stages: dict, tokenizers: list, scheduler, backbone_config, vae_scale: int,
                 device: torch.device, backbone: str):
        from diffusers.models.embeddings import Timesteps

        super().__init__(stages, tokenizers, scheduler, backbone_config, vae_scale, device, backbone)
        # The Fourier features of the time ids have no weights, so they need no graph.
        self.add_time_proj = Timesteps(backbone_config.addition_time_embed_dim, True, 0)

    @staticmethod
    def zero_negative(settings: SamplingSettings) -> bool:
        """An empty negative prompt is zeros, not encoded (diffusers' force_zeros_for_empty_prompt)."""
        return not settings.negative_prompt

    def texts(self, settings: SamplingSettings) -> list[str]:
        """With the empty negative prompt as zeros, the text encoders see only the prompts."""
        return list(settings.prompts) if self.zero_negative(settings) else super().texts(settings)

    def stage_batches(self, settings: SamplingSettings) -> dict[str, int]:
        return {**super().stage_batches(settings), "clip2": len(self.texts(settings))}

    def encode_window(self, token_ids: list[torch.Tensor], timer) -> tuple[torch.Tensor, torch.Tensor]:
        first = timer.time("clip1", self.stages["clip1"], input_ids=token_ids[0])["hidden_states"]
        second = timer.time("clip2", self.stages["clip2"], input_ids=token_ids[1])
        return torch.cat([first, second["hidden_states"]], dim=-1), second["pooled"]

    def negative_as_zeros(self, settings: SamplingSettings, context: torch.Tensor, pooled):
        if not self.zero_negative(settings):
            return context, pooled
        return torch.cat([torch.zeros_like(context), context]), torch.cat([torch.zeros_like(pooled), pooled])

    def extra_inputs(self, settings: SamplingSettings, pooled) -> dict[str, torch.Tensor]:
        return {"y": sdxl_y(self.add_time_proj, pooled, settings.height, settings.width)}


TINY = UNetSizes(
    text_widths=(32, 32), text_layers=(3, 3), text_heads=(4, 4), unet_channels=(32, 64),
    unet_down=("DownBlock2D", "CrossAttnDownBlock2D"), unet_up=("CrossAttnUpBlock2D", "UpBlock2D"),
    unet_transformer_layers=(1, 2), unet_head_dims=(2, 4), unet_groups=16, time_id_width=8,
    vae_channels=(8, 8, 16, 16), vae_groups=8, vae_layers=1, image_size=64)

# SDXL base 1.0's sizes.
FULL = UNetSizes(
    text_widths=(768, 1280), text_layers=(12, 32), text_heads=(12, 20), unet_channels=(320, 640, 1280),
    unet_down=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    unet_up=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), unet_transformer_layers=(1, 2, 10),
    unet_head_dims=(5, 10, 20), unet_groups=32, time_id_width=256, vae_channels=(128, 256, 512, 512),
    vae_groups=32, vae_layers=2, image_size=1024)

# The scene model's text-time embedding width: six time ids of 8 Fourier features each.
SCENE_TIME_ID_WIDTH = 8


def scene_sizes(arch, image_size: int) -> UNetSizes:
    """The scene model's architecture (config's SceneArchitecture): SDXL's layout, heads of 32
    features, one transformer layer per attention block; its VAE's scaling is set by training."""
    channels = tuple(arch.unet_channels)
    return UNetSizes(
        text_widths=tuple(arch.text_widths), text_layers=(arch.text_layers,) * 2,
        text_heads=tuple(max(1, width // 32) for width in arch.text_widths), unet_channels=channels,
        unet_down=("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (len(channels) - 1),
        unet_up=("CrossAttnUpBlock2D",) * (len(channels) - 1) + ("UpBlock2D",), unet_transformer_layers=1,
        unet_head_dims=tuple(width // 32 for width in channels), unet_groups=arch.norm_groups,
        time_id_width=SCENE_TIME_ID_WIDTH, vae_channels=tuple(arch.vae_channels), vae_groups=arch.norm_groups,
        vae_layers=arch.vae_layers, image_size=image_size, vae_config=(("force_upcast", False),))


def sdxl_unet(sizes: UNetSizes):
    """SDXL's UNet at `sizes`: text-time add-embeddings, linear projections in its transformers."""
    return build_unet(sizes, sum(sizes.text_widths), addition_embed_type="text_time",
                      addition_time_embed_dim=sizes.time_id_width,
                      projection_class_embeddings_input_dim=6 * sizes.time_id_width + sizes.text_widths[1],
                      transformer_layers_per_block=sizes.unet_transformer_layers, use_linear_projection=True)


class SDXLFamily(StableDiffusionFamily):
    """SDXL: two CLIP encoders (the second with projection), a UNet with text-time add-embeddings."""

    name = "sdxl"
    backbones = (Backbone("unet", "unet_xl"),)
    tokenizer_folders = ("tokenizer", "tokenizer_2")
    clip_tokenizers = ("tokenizer", "tokenizer_2")
    components = ("text_encoder", "text_encoder_2", "unet", "vae")
    sizes = {"tiny": TINY, "full": FULL}
    pooled_input = True
    text_to_image_class = SDXLTextToImage
    # The scene model's tokenizers (one CLIP tokenizer serves both encoders) and architecture.
    scene_tokenizers = ("clip",)

    def pipeline_class(self):
        from diffusers import StableDiffusionXLPipeline

        return StableDiffusionXLPipeline

    def text_networks(self) -> list[Network]:
        return [dataclasses.replace(clip_network("clip1"), guided=True),
                dataclasses.replace(clip_network("clip2", pooled=True), guided=True)]

    def text_graphs(self, pipe) -> list[tuple[Network, torch.nn.Module]]:
        first, second = self.text_networks()
        return [(first, ClipGraph(pipe.text_encoder, penultimate=True)),
                (second, ClipGraph(pipe.text_encoder_2, penultimate=True, pooled=True))]

    def text_graph_specs(self, pipe, ids: torch.Tensor, dtype) -> list:
        from ..graphs.specs import GraphSpec

        first, second = self.text_networks()
        return [GraphSpec(first, ClipGraph(pipe.text_encoder.to(dtype), penultimate=True), (ids,)),
                GraphSpec(second, ClipGraph(pipe.text_encoder_2.to(dtype), penultimate=True, pooled=True), (ids,))]

    def build_pipeline(self, sizes: UNetSizes, tokenizers: dict | None = None):
        from diffusers import StableDiffusionXLPipeline

        torch.manual_seed(SEED)
        tokenizer = (tokenizers or {}).get("clip") or components.byte_level_tokenizer()
        # Built in this order (VAE, encoders, UNet), so the tiny model's weights stay what they were.
        vae = unet_vae(sizes)
        encoders = [components.clip_text_encoder(tokenizer, width, layers, heads, projection=index == 1)
                    for index, (width, layers, heads) in enumerate(zip(sizes.text_widths, sizes.text_layers,
                                                                       sizes.text_heads))]
        unet = sdxl_unet(sizes)
        return StableDiffusionXLPipeline(vae=vae, text_encoder=encoders[0], text_encoder_2=encoders[1],
                                         tokenizer=tokenizer, tokenizer_2=tokenizer, unet=unet,
                                         scheduler=sd_scheduler(), add_watermarker=False)

    # --- the scene model -----------------------------------------------------------------------

    def scene_sizes(self, arch, image_size: int) -> UNetSizes:
        return scene_sizes(arch, image_size)

    def scene_loss(self, pipe, latents: torch.Tensor, data, block, generator: torch.Generator):
        """The UNet predicts the noise added under SDXL's DDPM schedule, conditioned on both
        encoders' penultimate hidden states side by side and the second's projected pooled output;
        a dropped caption is zeros, what the pipeline feeds for an empty negative prompt."""
        import torch.nn.functional as F
        from diffusers import DDPMScheduler

        from .training import autocast, kept

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


SDXL = SDXLFamily()
