"""The Flux text-to-image data flow of diffusers' FluxPipeline (CLIP's pooled embedding and T5's
hidden states, 2x2-packed latents with their position ids, flow-matching sigmas shifted by the
image's token count, the guidance embedding, unpack and decode), run over stages (sdquant.stages)
as sdquant.pipeline runs SD and SDXL, so the same loop drives engines, ONNX files and modules.
"""

from __future__ import annotations

import numpy as np
import torch

from .networks import TEXT_TOKENS
from .pipeline import SamplingSettings, say_truncated, warn_if_not_finite
from .progress import Progress
from .stages import StageTimer

# T5's sequence in diffusers' FluxPipeline (its max_sequence_length; Flux.1-schnell users often
# pass 256, which the graphs also take: their text axis is dynamic).
T5_TOKENS = 512


def text_tokens(t5_tokenizer) -> int:
    """T5's sequence length for a model: its tokenizer's own length up to diffusers' 512, so a model
    trained on short captions (the Flux scene model's 32) runs at the length it learned."""
    return min(T5_TOKENS, int(t5_tokenizer.model_max_length))


def calculate_shift(image_tokens: int, config) -> float:
    """The flow-matching shift `mu` for an image of this many packed tokens: linear between the
    scheduler's (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift), as diffusers
    computes it."""
    base_tokens, max_tokens = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    base_shift, max_shift = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
    slope = (max_shift - base_shift) / (max_tokens - base_tokens)
    return image_tokens * slope + base_shift - slope * base_tokens


class FluxTextToImage:
    """Flux's data flow over stages: clip (input_ids -> pooled), t5 (input_ids -> hidden_states),
    transformer (hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids,
    txt_ids[, guidance] -> latent) and vae (latent -> images). Mirrors diffusers' FluxPipeline, so the
    same prompt, seed and steps give the same image. Guidance is Flux-dev's embedded guidance
    (one transformer call per step); a model without it (schnell) ignores guidance_scale."""

    backbone = "transformer"

    def __init__(self, stages: dict, tokenizers: list, scheduler, transformer_config, vae_scale: int,
                 device: torch.device, latent_dtype: torch.dtype = torch.float32):
        self.stages = stages
        self.clip_tokenizer, self.t5_tokenizer = tokenizers
        self.tokenizers = tokenizers
        self.scheduler = scheduler
        self.transformer_config = transformer_config
        self.vae_scale = vae_scale
        self.device = device
        self.latent_dtype = latent_dtype
        self.told: set[str] = set()

    @property
    def guidance_embedded(self) -> bool:
        return bool(getattr(self.transformer_config, "guidance_embeds", False))

    def stage_batches(self, settings: SamplingSettings) -> dict[str, int]:
        """Samples per call of each stage: the text encoders see each prompt once, the transformer
        and the VAE every image."""
        images = len(settings.image_prompts)
        return {"clip": len(settings.prompts), "t5": len(settings.prompts), self.backbone: images, "vae": images}

    @property
    def text_tokens(self) -> int:
        return text_tokens(self.t5_tokenizer)

    def sequence_sizes(self, settings: SamplingSettings) -> dict[str, int]:
        """The length of each sequence axis of the graphs in a run: T5's tokens."""
        return {TEXT_TOKENS: self.text_tokens}

    def _ids(self, tokenizer, texts: list[str], length: int) -> torch.Tensor:
        ids = tokenizer(texts, padding="max_length", max_length=length, truncation=True, return_tensors="pt").input_ids
        return ids.to(device=self.device, dtype=torch.int32)

    def encode(self, settings: SamplingSettings, timer: StageTimer) -> tuple[torch.Tensor, torch.Tensor]:
        """T5's hidden states and CLIP's pooled embedding of each prompt, one per image."""
        say_truncated([self.clip_tokenizer], list(settings.prompts), self.told,
                      "Flux's pooled embedding reads only CLIP's window, as diffusers does")
        pooled = timer.time("clip", self.stages["clip"], input_ids=self._ids(
            self.clip_tokenizer, list(settings.prompts), self.clip_tokenizer.model_max_length))["pooled"]
        hidden = timer.time("t5", self.stages["t5"], input_ids=self._ids(
            self.t5_tokenizer, list(settings.prompts), self.text_tokens))["hidden_states"]
        repeat = settings.images_per_prompt
        return hidden.repeat_interleave(repeat, 0), pooled.repeat_interleave(repeat, 0)

    def latent_size(self, settings: SamplingSettings) -> tuple[int, int]:
        """Latent height and width: the image's over the VAE's scale, floored to whole 2x2 patches."""
        patch = self.vae_scale * 2
        return 2 * (settings.height // patch), 2 * (settings.width // patch)

    def generators(self, settings: SamplingSettings) -> list[torch.Generator]:
        return [torch.Generator(device=self.device).manual_seed(seed) for seed in settings.seeds]

    def initial_latents(self, settings: SamplingSettings, generators: list | None = None) -> torch.Tensor:
        """Unpacked noise (B, C, h, w), drawn as diffusers draws it: per image from its own seed, in
        the pipeline's dtype."""
        from diffusers.utils.torch_utils import randn_tensor

        height, width = self.latent_size(settings)
        shape = (len(settings.image_prompts), self.transformer_config.in_channels // 4, height, width)
        generators = generators or self.generators(settings)
        return randn_tensor(shape, generator=generators, device=self.device, dtype=self.latent_dtype)

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

    def predict(self, settings: SamplingSettings, step: int, inputs: dict, timer: StageTimer) -> torch.Tensor:
        """The transformer's velocity at this step; under a cache hook, a generation's first step
        starts the hook afresh."""
        stage = self.stages[self.backbone]
        if settings.cache is not None and step == 0:
            stage.reset()
        return timer.time(self.backbone, stage, **inputs)["latent"]

    def __call__(self, settings: SamplingSettings, timer: StageTimer, progress: bool = True,
                 latents: torch.Tensor | None = None) -> torch.Tensor:
        """Images in [0, 1], (B, 3, H, W), float32."""
        hidden, pooled = self.encode(settings, timer)
        height, width = self.latent_size(settings)
        generators = self.generators(settings)
        latents = self.pack(self.initial_latents(settings, generators) if latents is None else latents)
        image_ids = self.image_ids(height, width)
        self.set_timesteps(settings.steps, latents.shape[1])
        guidance = (torch.full([latents.shape[0]], settings.guidance_scale, device=self.device, dtype=torch.float32)
                    if self.guidance_embedded else None)
        self.scheduler.set_begin_index(0)
        for step, t in enumerate(Progress(self.scheduler.timesteps, "denoising", "steps", show=progress, leave=False)):
            inputs = self.backbone_inputs(latents, t, hidden, pooled, image_ids, guidance)
            velocity = self.predict(settings, step, inputs, timer)
            latents = self.scheduler.step(velocity, t, latents, return_dict=False)[0]
        unpacked = self.unpack(latents, height, width)
        images = timer.time("vae", self.stages["vae"], latent=unpacked)["images"].float()
        warn_if_not_finite(unpacked, images)
        return (images / 2 + 0.5).clamp(0, 1)
