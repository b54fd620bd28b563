"""The UNet families' text-to-image data flows over stages, read top to bottom like diffusers'
StableDiffusionPipeline and StableDiffusionXLPipeline, DeepCache's passes included."""

from __future__ import annotations

import torch

from .deep_cache import DEEP, FULL, SHALLOW
from .graphs import unet_axis_sizes
from ...graphs.networks import TOKENS
from ..pipeline import SamplingSettings, TextToImage, dropped_words, prompt_windows, say_truncated


class SDTextToImage(TextToImage):
    """SD's data flow over stages (clip1: input_ids -> hidden_states; unet: x, timesteps, context ->
    out; vae: latent -> images), as diffusers' StableDiffusionPipeline runs it, so the same prompt,
    seed and scheduler give the same image. A step cache (DeepCache) runs the UNet's full pass every
    interval steps and its shallow pass between."""

    def __init__(self, stages: dict, tokenizers: list, scheduler, backbone_config, vae_scale: int,
                 device: torch.device, backbone: str):
        super().__init__(stages, tokenizers, scheduler, backbone_config, vae_scale, device)
        self.backbone = backbone
        self.deep: torch.Tensor | None = None  # with a step cache: the deep feature of the last full pass

    # --- what each stage sees ------------------------------------------------------------------

    def texts(self, settings: SamplingSettings) -> list[str]:
        """What the text encoders encode, [negative..., positive...] as the diffusers pipelines batch
        them, each prompt once (its images share its embeddings)."""
        return [settings.negative_prompt] * len(settings.prompts) + list(settings.prompts)

    def stage_batches(self, settings: SamplingSettings) -> dict[str, int]:
        images = len(settings.image_prompts)
        return {"clip1": len(self.texts(settings)), self.backbone: 2 * images if settings.guided else images,
                "vae": images}

    def words_lost(self, text: str) -> tuple[str, str]:
        dropped = dropped_words(self.tokenizers, text)
        return (f"CLIP's {TOKENS} tokens", dropped) if dropped else ("", "")

    def context_windows(self, settings: SamplingSettings) -> int:
        """CLIP windows in the UNet's context: 1, or with long_prompts=chunk as many as the longest
        text needs (the others are padded with empty windows, so all share one length)."""
        if settings.long_prompts != "chunk":
            return 1
        return max(len(prompt_windows(tokenizer, text)) for tokenizer in self.tokenizers
                   for text in self.texts(settings))

    def axis_sizes(self, settings: SamplingSettings) -> dict[str, int]:
        return unet_axis_sizes(*self.latent_size(settings), self.context_windows(settings),
                               None if settings.cache is None else settings.cache.branch)

    def latent_shape(self, settings: SamplingSettings) -> tuple[int, ...]:
        return (len(settings.image_prompts), self.backbone_config.in_channels, *self.latent_size(settings))

    # --- the steps of __call__ -----------------------------------------------------------------

    def token_ids(self, tokenizer, settings: SamplingSettings) -> torch.Tensor:
        """(windows, texts, TOKENS) int32 token ids of the texts, each padded to the same windows."""
        windows = self.context_windows(settings)
        empty = prompt_windows(tokenizer, "")
        ids = [(prompt_windows(tokenizer, text) + empty * windows)[:windows] for text in self.texts(settings)]
        return torch.tensor(ids, dtype=torch.int32).transpose(0, 1)

    def encode_window(self, token_ids: list[torch.Tensor], timer) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One CLIP window of every text: its hidden states (and pooled embedding, for SDXL)."""
        return timer.time("clip1", self.stages["clip1"], input_ids=token_ids[0])["hidden_states"], None

    def encode(self, settings: SamplingSettings, timer) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The context (each CLIP window's hidden states, joined along the sequence) and the pooled
        embedding (the first window's; SDXL's) of [negative..., positive...], one per image."""
        if settings.long_prompts != "chunk":
            say_truncated(self.tokenizers, self.texts(settings), self.told, "sampling.long_prompts=chunk keeps them")
        token_ids = [self.token_ids(tokenizer, settings).to(self.device) for tokenizer in self.tokenizers]
        windows, pooled = [], None
        for window in range(token_ids[0].shape[0]):
            hidden, window_pooled = self.encode_window([ids[window] for ids in token_ids], timer)
            windows.append(hidden)
            pooled = window_pooled if pooled is None else pooled
        context, pooled = self.negative_as_zeros(settings, torch.cat(windows, dim=1), pooled)
        repeat = settings.images_per_prompt
        return context.repeat_interleave(repeat, 0), None if pooled is None else pooled.repeat_interleave(repeat, 0)

    def negative_as_zeros(self, settings: SamplingSettings, context: torch.Tensor, pooled):
        """SD encodes its negative prompt, empty or not."""
        return context, pooled

    def extra_inputs(self, settings: SamplingSettings, pooled) -> dict[str, torch.Tensor]:
        """The UNet's inputs besides x, timesteps and context (SDXL's y), for both guidance halves."""
        return {}

    def predict(self, settings: SamplingSettings, step: int, inputs: dict, timer) -> torch.Tensor:
        """The UNet's output at this step: the whole UNet, or with a step cache its full pass
        (which also gives the deep feature to keep) or its shallow pass (which takes it)."""
        cache = settings.cache
        if cache is None:
            return timer.time(self.backbone, self.stages[self.backbone], **inputs)["out"]
        if cache.full_step(step):
            outputs = timer.time(self.backbone, self.stages[FULL.format(self.backbone)], **inputs)
            self.deep = outputs[DEEP]
            return outputs["out"]
        return timer.time(self.backbone, self.stages[SHALLOW.format(self.backbone)], **inputs, deep=self.deep)["out"]

    def __call__(self, settings: SamplingSettings, timer, progress: bool = True,
                 latents: torch.Tensor | None = None) -> torch.Tensor:
        from ...progress import Progress

        # 1. Encode the prompts (and the negative prompt) with the text encoders.
        context, pooled = self.encode(settings, timer)
        extra = self.extra_inputs(settings, pooled)
        # 2. The timesteps and the initial noise, from each image's own generator.
        self.scheduler.set_timesteps(settings.steps, device=self.device)
        generators = self.generators(settings)
        latents = self.initial_latents(settings, generators) if latents is None else latents
        latents = latents * self.scheduler.init_noise_sigma
        step_kwargs = self.scheduler_step_kwargs(generators)
        guided = settings.guided
        # 3. Denoise, with classifier-free guidance over a doubled batch.
        for step, t in enumerate(Progress(self.scheduler.timesteps, "denoising", "steps", show=progress,
                                          leave=False)):
            x = torch.cat([latents] * 2) if guided else latents
            x = self.scheduler.scale_model_input(x, t)
            inputs = {"x": x, "timesteps": t.float().expand(x.shape[0]),
                      "context": context if guided else context[context.shape[0] // 2:]}
            inputs.update({name: value if guided else value[value.shape[0] // 2:] for name, value in extra.items()})
            noise = self.predict(settings, step, inputs, timer).float()
            if guided:
                uncond, cond = noise.chunk(2)
                noise = uncond + settings.guidance_scale * (cond - uncond)
            latents = self.scheduler.step(noise, t, latents, **step_kwargs, return_dict=False)[0]
        # 4. Decode.
        return self.decode(latents, timer)


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
