"""Wan2.2's text-to-video data flow over stages, read top to bottom like diffusers' WanPipeline:
encode the prompt and the negative prompt with UMT5, draw the video latent's noise, denoise with
the high-noise expert while t >= boundary_ratio x 1000 and the low-noise expert after, and decode
the frames. The two guidance halves reach the expert's stage as one batch of two, which the torch
backend runs as WanPipeline does, one half after the other (WanFamily.backbone_call_samples says
why), and an engine as one call: the same predictions. An expert sampled at guidance scale 1 (a
scene model's low-noise one) takes the conditional half alone where its stage can."""

from __future__ import annotations

import torch

from ...graphs.networks import FRAMES, HEIGHT, TEXT_TOKENS, WIDTH
from ...parallel import GuidanceHalf
from .graphs import LATENT_TOKENS
from ..pipeline import SamplingSettings, TextToImage, shortened, warn_if_not_finite

# WanPipeline's UMT5 sequence (its max_sequence_length default in __call__).
UMT5_TOKENS = 512


def text_tokens(tokenizer, max_tokens: int) -> int:
    """UMT5's sequence: the tokenizer's own length up to WanPipeline's 512, so a model trained on
    short captions runs at the length it learned."""
    return min(max_tokens, int(tokenizer.model_max_length))


# Frames a latent frame stands for after the first in the Wan VAEs (a scene model's VAE may pack
# fewer, but the 4k + 1 frames every Wan VAE takes suit it too).
TEMPORAL_SCALE = 4


def temporal_scale(vae_config) -> int:
    """Frames a latent frame stands for after the first: a scene model's own where it packs fewer,
    else the Wan VAEs' (configs saved before diffusers wrote the key are the Wan2.1 VAE's)."""
    return vae_config.get("scale_factor_temporal", TEMPORAL_SCALE)


def latent_frames(frames: int, temporal_scale: int) -> int:
    """Latent frames of a video of `frames` (4k + 1 for a temporal scale of 4: the first frame alone,
    then 4 a latent frame)."""
    return (frames - 1) // temporal_scale + 1


def latent_tokens(frames: int, height: int, width: int) -> int:
    """The tokens an expert attends over: one per 1x2x2 patch of a latent of that many frames,
    height and width."""
    return frames * (height // 2) * (width // 2)


def expert_at(t, boundary_ratio: float | None, train_steps: int, experts: int) -> int:
    """Which expert denoises at timestep t: the first while t >= boundary_ratio x the scheduler's
    training steps, the second after (a model of one expert: always the first)."""
    if boundary_ratio is None or experts == 1:
        return 0
    return 0 if t >= boundary_ratio * train_steps else 1


class WanTextToVideo(TextToImage):
    """Stages umt5 (input_ids, attention_mask -> hidden_states), transformer and transformer_2 (each
    expert: hidden_states, timestep, encoder_hidden_states -> latent) and vae (latent -> video); a
    model of one expert (Wan2.2-TI2V-5B) runs `transformer` at every step, with the timestep
    expanded to one per latent token where its pipeline does so."""

    def __init__(self, stages: dict, tokenizers: list, scheduler, backbone_config, vae_config: dict,
                 device: torch.device, experts: tuple[str, ...], boundary_ratio: float | None,
                 expand_timesteps: bool, max_text_tokens: int):
        # Configs saved before diffusers wrote the key are the Wan2.1 VAE's: 8x in space.
        spatial = vae_config.get("scale_factor_spatial", 8)
        self.temporal_scale = temporal_scale(vae_config)
        super().__init__(stages, tokenizers, scheduler, backbone_config, spatial, device)
        (self.tokenizer,) = tokenizers
        self.experts = experts
        self.boundary_ratio = boundary_ratio
        self.expand_timesteps = expand_timesteps
        self.text_length = text_tokens(self.tokenizer, max_text_tokens)

    @property
    def backbone(self) -> str:
        return self.experts[0]

    @property
    def backbones(self) -> tuple[str, ...]:
        return self.experts

    # --- what each stage sees ------------------------------------------------------------------

    def texts(self, settings: SamplingSettings) -> list[str]:
        """[negative..., positive...] under guidance, each prompt once; the prompts alone without; each
        cleaned as WanPipeline cleans it (HTML entities, runs of spaces, and ftfy's fixes where ftfy
        is installed)."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        negatives = [settings.negative_prompt] * len(settings.prompts) if settings.guided else []
        return [prompt_clean(text) for text in negatives + list(settings.prompts)]

    def stage_batches(self, settings: SamplingSettings) -> dict[str, int]:
        videos = len(settings.image_prompts)
        return {"umt5": len(self.texts(settings)),
                **{graph: self.halves(settings, expert) * videos for expert, graph in enumerate(self.experts)},
                "vae": videos}

    @staticmethod
    def scales(settings: SamplingSettings) -> tuple[float, float]:
        """Each expert's guidance scale: the second's guidance_scale_2, else guidance_scale."""
        second = settings.guidance_scale if settings.guidance_scale_2 is None else settings.guidance_scale_2
        return settings.guidance_scale, second

    def halves(self, settings: SamplingSettings, expert: int) -> int:
        """The samples a video's call of this expert holds: both guidance halves under guidance, the
        conditional one alone where the expert's scale is 1 or less (its guided velocity is then the
        conditional one, so the unconditional half is work WanPipeline does for nothing) and its stage
        takes one. An expert's engine or ONNX graph is traced on both halves (WanFamily.graph_specs),
        and a stage that runs the halves on two processes (parallel.cfg) takes both."""
        if not settings.guided:
            return 1
        if self.scales(settings)[expert] > 1.0:
            return 2
        stage = self.stages.get(self.experts[expert])
        return 2 if hasattr(stage, "profiles") or isinstance(stage, GuidanceHalf) else 1

    def axis_sizes(self, settings: SamplingSettings) -> dict[str, int]:
        height, width = self.latent_size(settings)
        frames = latent_frames(settings.frames, self.temporal_scale)
        return {FRAMES: frames, HEIGHT: height, WIDTH: width, TEXT_TOKENS: self.text_length,
                LATENT_TOKENS: latent_tokens(frames, height, width)}

    def latent_shape(self, settings: SamplingSettings) -> tuple[int, ...]:
        return (len(settings.image_prompts), self.backbone_config.in_channels,
                latent_frames(settings.frames, self.temporal_scale), *self.latent_size(settings))

    def words_lost(self, text: str) -> tuple[str, str]:
        ids = self.tokenizer(text, truncation=False).input_ids
        if len(ids) <= self.text_length:
            return "", ""
        return f"UMT5's {self.text_length} tokens", self.tokenizer.decode(ids[self.text_length - 1:],
                                                                          skip_special_tokens=True)

    # --- the steps of __call__ -----------------------------------------------------------------

    def encode(self, settings: SamplingSettings, timer) -> torch.Tensor:
        """UMT5's hidden states of [negative..., positive...] (zero past each text's length), one
        per video."""
        texts = self.texts(settings)
        for text in dict.fromkeys(texts):
            limit, dropped = self.words_lost(text)
            if dropped and text not in self.told:
                self.told.add(text)
                print(f"warning: prompt {shortened(text)!r} is longer than {limit} and is cut, dropping {dropped!r}",
                      flush=True)
        tokens = self.tokenizer(texts, padding="max_length", max_length=self.text_length, truncation=True,
                                return_attention_mask=True, return_tensors="pt")
        hidden = timer.time("umt5", self.stages["umt5"], input_ids=tokens.input_ids.to(self.device, torch.int32),
                            attention_mask=tokens.attention_mask.to(self.device, torch.int32))["hidden_states"]
        return hidden.repeat_interleave(settings.images_per_prompt, 0)

    def expert_at(self, t: torch.Tensor) -> int:
        return expert_at(t, self.boundary_ratio, self.scheduler.config.num_train_timesteps, len(self.experts))

    def timesteps_for(self, t: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """The timestep each expert call takes: one per sample, or (expand_timesteps) one per latent
        token of its 2x2 patches, as WanPipeline makes it."""
        if not self.expand_timesteps:
            return t.float().expand(latents.shape[0])
        frames, height, width = latents.shape[2:]
        per_token = t.float().to(latents.device).expand(latent_tokens(frames, height, width))
        return per_token[None].expand(latents.shape[0], -1)

    def predict(self, settings: SamplingSettings, step: int, inputs: dict, timer) -> torch.Tensor:
        """The velocity of the expert that serves this call's timestep (read from its inputs); `step`
        counts that expert's calls (teacher forcing's index), so its first starts the expert's cache
        hook afresh."""
        expert = self.expert_at(inputs["timestep"].flatten()[0])
        if step == 0:
            self.restart_caches(settings, (self.experts[expert],))
        return self.velocity(expert, inputs, timer)

    def restart_caches(self, settings: SamplingSettings, experts: tuple[str, ...]) -> None:
        """Clears the cache hook state (what it keeps of earlier steps) of these experts' stages,
        where the run has a step cache."""
        if settings.cache is not None:
            for graph in experts:
                self.stages[graph].reset()

    def velocity(self, expert: int, inputs: dict, timer) -> torch.Tensor:
        graph = self.experts[expert]
        return timer.time(graph, self.stages[graph], **inputs)["latent"]

    def decode(self, latents: torch.Tensor, timer) -> torch.Tensor:
        """Videos in [0, 1], (B, F, 3, H, W), float32, from the final latents."""
        video = timer.time("vae", self.stages["vae"], latent=latents)["video"].float()
        warn_if_not_finite(latents, video)
        return (video / 2 + 0.5).clamp(0, 1).transpose(1, 2)

    def __call__(self, settings: SamplingSettings, timer, progress: bool = True,
                 latents: torch.Tensor | None = None) -> torch.Tensor:
        from ...progress import Progress

        # 1. Encode the prompts (and the negative prompt) with UMT5.
        text = self.encode(settings, timer)
        # 2. The timesteps and the video latent's noise, from each video's own generator.
        self.scheduler.set_timesteps(settings.steps, device=self.device)
        latents = self.initial_latents(settings) if latents is None else latents
        self.scheduler.set_begin_index(0)
        scales = self.scales(settings)
        both = [self.halves(settings, expert) == 2 for expert in range(len(self.experts))]
        conditional_text = text[text.shape[0] // 2:] if settings.guided else text
        # Each step's expert, read once from the host's copy of the schedule: no wait inside the loop.
        experts = [self.expert_at(t) for t in self.scheduler.timesteps.cpu()]
        # 3. Denoise: each step's expert, the guidance halves as one batch where it takes both; a new
        # video starts every expert's cache hook afresh, the second expert's too.
        self.restart_caches(settings, self.experts)
        for step, t in enumerate(Progress(self.scheduler.timesteps, "denoising", "steps", show=progress, leave=False)):
            expert = experts[step]
            x = torch.cat([latents] * 2) if both[expert] else latents
            inputs = {"hidden_states": x, "timestep": self.timesteps_for(t, x),
                      "encoder_hidden_states": text if both[expert] else conditional_text}
            velocity = self.velocity(expert, inputs, timer).float()
            if both[expert]:
                uncond, cond = velocity.chunk(2)
                velocity = uncond + scales[expert] * (cond - uncond)
            latents = self.scheduler.step(velocity, t, latents, return_dict=False)[0]
        # 4. Decode the frames, the caches' state dropped first: past the last step it only takes the
        # room the decoder's activations need (for the A14B at 720p First Block Cache keeps three 0.7 GiB
        # copies of the hidden states for each expert's guidance half, 8.7 GiB in all).
        self.restart_caches(settings, self.experts)
        return self.decode(latents, timer)
