"""Flux's text-to-image data flow over stages, read top to bottom like diffusers' FluxPipeline."""

from __future__ import annotations

import numpy as np
import torch

from ..dit import calculate_shift, text_tokens
from ...graphs.networks import HEIGHT, TEXT_TOKENS, WIDTH
from .graphs import IMAGE_TOKENS
from ..pipeline import SamplingSettings, TextToImage, padded_ids, say_truncated, t5_dropped_words

# T5's sequence in diffusers' FluxPipeline (its max_sequence_length; Flux.1-schnell users often
# pass 256, which the graphs also take: their text axis is dynamic).
T5_TOKENS = 512


def flux_axis_sizes(latent_height: int, latent_width: int, t5_tokens: int) -> dict[str, int]:
    """The Flux graphs' axes: the latent's sides (the VAE), its 2x2-packed tokens and T5's tokens."""
    return {HEIGHT: latent_height, WIDTH: latent_width, IMAGE_TOKENS: (latent_height // 2) * (latent_width // 2),
            TEXT_TOKENS: t5_tokens}


class FluxTextToImage(TextToImage):
    """Flux's data flow over stages: clip (input_ids -> pooled), t5 (input_ids -> hidden_states),
    transformer (hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids,
    txt_ids[, guidance] -> latent) and vae (latent -> images). Mirrors diffusers' FluxPipeline, so the
    same prompt, seed and steps give the same image. Guidance is Flux-dev's embedded guidance
    (one transformer call per step); a model without it (schnell) ignores guidance_scale."""

    backbone = "transformer"

    def __init__(self, stages: dict, tokenizers: list, scheduler, backbone_config, vae_scale: int,
                 device: torch.device):
        super().__init__(stages, tokenizers, scheduler, backbone_config, vae_scale, device)
        self.clip_tokenizer, self.t5_tokenizer = tokenizers

    @property
    def guidance_embedded(self) -> bool:
        return bool(getattr(self.backbone_config, "guidance_embeds", False))

    @property
    def text_tokens(self) -> int:
        return text_tokens(self.t5_tokenizer, T5_TOKENS)

    def stage_batches(self, settings: SamplingSettings) -> dict[str, int]:
        """The text encoders see each prompt once, the transformer and the VAE every image."""
        images = len(settings.image_prompts)
        return {"clip": len(settings.prompts), "t5": len(settings.prompts), self.backbone: images, "vae": images}

    def axis_sizes(self, settings: SamplingSettings) -> dict[str, int]:
        return flux_axis_sizes(*self.latent_size(settings), self.text_tokens)

    def latent_size(self, settings: SamplingSettings) -> tuple[int, int]:
        """Latent height and width: the image's over the VAE's scale, floored to whole 2x2 patches."""
        patch = self.vae_scale * 2
        return 2 * (settings.height // patch), 2 * (settings.width // patch)

    def latent_shape(self, settings: SamplingSettings) -> tuple[int, ...]:
        """Unpacked noise (B, C, h, w), as diffusers draws it before packing."""
        return (len(settings.image_prompts), self.backbone_config.in_channels // 4, *self.latent_size(settings))

    def words_lost(self, text: str) -> tuple[str, str]:
        # CLIP's cut only shortens the pooled embedding: T5 still reads those words.
        dropped = t5_dropped_words(self.t5_tokenizer, text, self.text_tokens)
        return (f"T5's {self.text_tokens} tokens", dropped) if dropped else ("", "")

    def encode(self, settings: SamplingSettings, timer) -> tuple[torch.Tensor, torch.Tensor]:
        """T5's hidden states and CLIP's pooled embedding of each prompt, one per image."""
        say_truncated([self.clip_tokenizer], list(settings.prompts), self.told,
                      "Flux's pooled embedding reads only CLIP's window, as diffusers does")
        pooled = timer.time("clip", self.stages["clip"], input_ids=padded_ids(
            self.clip_tokenizer, list(settings.prompts), self.clip_tokenizer.model_max_length, self.device))["pooled"]
        hidden = timer.time("t5", self.stages["t5"], input_ids=padded_ids(
            self.t5_tokenizer, list(settings.prompts), self.text_tokens, self.device))["hidden_states"]
        repeat = settings.images_per_prompt
        return hidden.repeat_interleave(repeat, 0), pooled.repeat_interleave(repeat, 0)

    @staticmethod
    def pack(latents: torch.Tensor) -> torch.Tensor:
        """(B, C, h, w) -> (B, h/2 * w/2, 4C): each 2x2 patch one token, as diffusers packs them."""
        batch, channels, height, width = latents.shape
        patches = latents.view(batch, channels, height // 2, 2, width // 2, 2).permute(0, 2, 4, 1, 3, 5)
        return patches.reshape(batch, (height // 2) * (width // 2), channels * 4)

    @staticmethod
    def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
        batch, _, features = tokens.shape
        patches = tokens.view(batch, height // 2, width // 2, features // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return patches.reshape(batch, features // 4, height, width)

    def image_ids(self, height: int, width: int) -> torch.Tensor:
        """(h/2 * w/2, 3) position ids of the packed tokens: 0, row, column."""
        ids = torch.zeros(height // 2, width // 2, 3)
        ids[..., 1] += torch.arange(height // 2)[:, None]
        ids[..., 2] += torch.arange(width // 2)[None, :]
        return ids.reshape(-1, 3).to(self.device)

    def set_timesteps(self, steps: int, image_tokens: int) -> None:
        """diffusers' default sigmas, 1 to 1/steps, shifted for the image's token count."""
        sigmas = np.linspace(1.0, 1 / steps, steps)
        if self.scheduler.config.get("use_flow_sigmas", False):
            sigmas = None
        self.scheduler.set_timesteps(sigmas=sigmas, device=self.device,
                                     mu=calculate_shift(image_tokens, self.scheduler.config))

    def backbone_inputs(self, latents: torch.Tensor, t: torch.Tensor, hidden: torch.Tensor, pooled: torch.Tensor,
                        image_ids: torch.Tensor, guidance: torch.Tensor | None) -> dict[str, torch.Tensor]:
        inputs = {"hidden_states": latents, "encoder_hidden_states": hidden, "pooled_projections": pooled,
                  "timestep": (t.expand(latents.shape[0]).to(latents.dtype) / 1000),
                  "img_ids": image_ids, "txt_ids": torch.zeros(hidden.shape[1], 3, device=self.device)}
        if guidance is not None:
            inputs["guidance"] = guidance
        return inputs

    def predict(self, settings: SamplingSettings, step: int, inputs: dict, timer) -> torch.Tensor:
        """The transformer's velocity at this step; under a cache hook, a generation's first step
        starts the hook afresh."""
        stage = self.stages[self.backbone]
        if settings.cache is not None and step == 0:
            stage.reset()
        return timer.time(self.backbone, stage, **inputs)["latent"]

    def __call__(self, settings: SamplingSettings, timer, progress: bool = True,
                 latents: torch.Tensor | None = None) -> torch.Tensor:
        from ...progress import Progress

        # 1. Encode the prompts: T5's hidden states and CLIP's pooled embedding.
        hidden, pooled = self.encode(settings, timer)
        # 2. The packed initial noise, its position ids, and the sigmas shifted for its token count.
        height, width = self.latent_size(settings)
        latents = self.pack(self.initial_latents(settings) if latents is None else latents)
        image_ids = self.image_ids(height, width)
        self.set_timesteps(settings.steps, latents.shape[1])
        guidance = (torch.full([latents.shape[0]], settings.guidance_scale, device=self.device, dtype=torch.float32)
                    if self.guidance_embedded else None)
        self.scheduler.set_begin_index(0)
        # Each row's timestep as backbone_inputs gives it, at every step.
        timesteps = self.scheduler.timesteps[:, None].expand(-1, len(latents)).to(latents.dtype) / 1000
        embedded = {"pooled_projections": pooled, **({} if guidance is None else {"guidance": guidance})}
        modulations = self.step_modulations(timesteps, embedded, timer)
        # 3. Denoise: one transformer call per step (guidance is an embedding, not a second batch).
        for step, t in enumerate(Progress(self.scheduler.timesteps, "denoising", "steps", show=progress, leave=False)):
            conditioning = pooled if modulations is None else modulations[step]
            inputs = self.backbone_inputs(latents, t, hidden, conditioning, image_ids, guidance)
            velocity = self.predict(settings, step, inputs, timer)
            latents = self.scheduler.step(velocity, t, latents, return_dict=False)[0]
        # 4. Unpack and decode, the cache's state dropped first (the decoder needs the room).
        if settings.cache is not None:
            self.stages[self.backbone].reset()
        return self.decode(self.unpack(latents, height, width), timer)
