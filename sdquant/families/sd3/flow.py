"""SD3.5's text-to-image data flow over stages, read top to bottom like diffusers'
StableDiffusion3Pipeline, classifier-free guidance over a doubled batch included."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from ..dit import calculate_shift, text_tokens
from ...graphs.networks import HEIGHT, TEXT_TOKENS, TOKENS, WIDTH
from .graphs import JOINT_TOKENS
from ..pipeline import SamplingSettings, TextToImage, padded_ids, say_truncated, shortened, t5_dropped_words

# T5's sequence in diffusers' StableDiffusion3Pipeline (its max_sequence_length default).
T5_TOKENS = 256


def sd3_axis_sizes(latent_height: int, latent_width: int, t5_tokens: int) -> dict[str, int]:
    """The SD3 graphs' axes: the latent's sides, T5's tokens and the joint text axis."""
    return {HEIGHT: latent_height, WIDTH: latent_width, TEXT_TOKENS: t5_tokens, JOINT_TOKENS: TOKENS + t5_tokens}


class SD3TextToImage(TextToImage):
    """SD3's data flow over stages: clip_l and clip_g (input_ids -> hidden_states, pooled), t5
    (input_ids -> hidden_states), transformer (hidden_states, encoder_hidden_states,
    pooled_projections, timestep -> latent) and vae (latent -> images). Mirrors diffusers'
    StableDiffusion3Pipeline, so the same prompt, seed and steps give the same image: the negative
    prompt (empty or not) is encoded, and guidance runs it and the prompt as one doubled batch."""

    backbone = "transformer"

    def __init__(self, stages: dict, tokenizers: list, scheduler, backbone_config, vae_scale: int,
                 device: torch.device):
        super().__init__(stages, tokenizers, scheduler, backbone_config, vae_scale, device)
        *self.clip_tokenizers, self.t5_tokenizer = tokenizers
        self.told_t5: set[str] = set()  # the prompts already said to be cut by T5

    @property
    def text_tokens(self) -> int:
        return text_tokens(self.t5_tokenizer, T5_TOKENS)

    def texts(self, settings: SamplingSettings) -> list[str]:
        """What the text encoders encode: [negative..., positive...] under guidance, each prompt
        once (its images share its embeddings); the prompts alone without."""
        negatives = [settings.negative_prompt] * len(settings.prompts) if settings.guided else []
        return negatives + list(settings.prompts)

    def stage_batches(self, settings: SamplingSettings) -> dict[str, int]:
        texts, images = len(self.texts(settings)), len(settings.image_prompts)
        return {"clip_l": texts, "clip_g": texts, "t5": texts, self.backbone: 2 * images if settings.guided else images,
                "vae": images}

    def axis_sizes(self, settings: SamplingSettings) -> dict[str, int]:
        return sd3_axis_sizes(*self.latent_size(settings), self.text_tokens)

    def latent_shape(self, settings: SamplingSettings) -> tuple[int, ...]:
        return (len(settings.image_prompts), self.backbone_config.in_channels, *self.latent_size(settings))

    def words_lost(self, text: str) -> tuple[str, str]:
        # CLIP's cut only shortens its part of the context: T5 still reads those words.
        dropped = t5_dropped_words(self.t5_tokenizer, text, self.text_tokens)
        return (f"T5's {self.text_tokens} tokens", dropped) if dropped else ("", "")

    def say_cut(self, texts: list[str]) -> None:
        """Says once per prompt where CLIP's window, and where T5's length, cuts it."""
        say_truncated(self.clip_tokenizers, texts, self.told,
                      f"T5 still reads up to {self.text_tokens} tokens of it, as in diffusers")
        for text in dict.fromkeys(texts):
            if text in self.told_t5:
                continue
            limit, dropped = self.words_lost(text)
            if dropped:
                self.told_t5.add(text)
                print(f"warning: prompt {shortened(text)!r} is longer than {limit} and is cut, dropping {dropped!r}, "
                      "as diffusers does", file=sys.stderr, flush=True)

    def encode(self, settings: SamplingSettings, timer) -> tuple[torch.Tensor, torch.Tensor]:
        """The joint text states (both CLIP encoders' penultimate hidden states side by side, padded
        to T5's width, then T5's hidden states along the sequence) and the pooled embedding (both
        CLIP projections) of every text, one per image."""
        texts = self.texts(settings)
        self.say_cut(texts)
        clip_states, pooled = [], []
        for name, tokenizer in zip(("clip_l", "clip_g"), self.clip_tokenizers):
            out = timer.time(name, self.stages[name], input_ids=padded_ids(tokenizer, texts, TOKENS, self.device))
            clip_states.append(out["hidden_states"])
            pooled.append(out["pooled"])
        t5 = timer.time("t5", self.stages["t5"], input_ids=padded_ids(
            self.t5_tokenizer, texts, self.text_tokens, self.device))["hidden_states"]
        clip = torch.cat(clip_states, dim=-1)
        context = torch.cat([F.pad(clip, (0, t5.shape[-1] - clip.shape[-1])), t5], dim=1)
        repeat = settings.images_per_prompt
        return context.repeat_interleave(repeat, 0), torch.cat(pooled, dim=-1).repeat_interleave(repeat, 0)

    def set_timesteps(self, steps: int, latent_height: int, latent_width: int) -> None:
        """The scheduler's own sigmas, shifted for the image's patch count where its config asks
        for dynamic shifting, as diffusers sets them."""
        shift = {}
        if self.scheduler.config.get("use_dynamic_shifting"):
            patch = self.backbone_config.patch_size
            shift["mu"] = calculate_shift((latent_height // patch) * (latent_width // patch), self.scheduler.config)
        self.scheduler.set_timesteps(steps, device=self.device, **shift)

    def predict(self, settings: SamplingSettings, step: int, inputs: dict, timer) -> torch.Tensor:
        return timer.time(self.backbone, self.stages[self.backbone], **inputs)["latent"]

    def __call__(self, settings: SamplingSettings, timer, progress: bool = True,
                 latents: torch.Tensor | None = None) -> torch.Tensor:
        from ...progress import Progress

        # 1. Encode the prompts (and, under guidance, the negative prompt) with all three encoders.
        context, pooled = self.encode(settings, timer)
        # 2. The initial noise and the timesteps.
        latents = self.initial_latents(settings) if latents is None else latents
        self.set_timesteps(settings.steps, *latents.shape[-2:])
        guided = settings.guided
        modulations = self.step_modulations(self.scheduler.timesteps[:, None].expand(-1, len(pooled)),
                                            {"pooled_projections": pooled}, timer)
        # 3. Denoise, with classifier-free guidance over a doubled batch.
        for step, t in enumerate(Progress(self.scheduler.timesteps, "denoising", "steps", show=progress, leave=False)):
            x = torch.cat([latents] * 2) if guided else latents
            inputs = {"hidden_states": x, "encoder_hidden_states": context,
                      "pooled_projections": pooled if modulations is None else modulations[step],
                      "timestep": t.expand(x.shape[0])}
            velocity = self.predict(settings, step, inputs, timer)
            if guided:
                uncond, cond = velocity.chunk(2)
                velocity = uncond + settings.guidance_scale * (cond - uncond)
            latents = self.scheduler.step(velocity, t, latents, return_dict=False)[0]
        # 4. Decode (the VAE's graph unscales and unshifts the latents).
        return self.decode(latents, timer)
