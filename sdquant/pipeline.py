"""The text-to-image pipeline: the SDXL / SD data flow of the diffusers pipelines (encode the
prompts, denoise with a diffusers scheduler and classifier-free guidance, decode), run over
stages (sdquant.stages), so one loop drives the TensorRT engines, the ONNX files and the
diffusers modules alike.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass

import torch

from .errors import UserError
from .networks import CONTEXT, TOKENS
from .progress import Progress
from .stages import StageTimer

SCHEDULERS = {"euler": "EulerDiscreteScheduler", "euler_a": "EulerAncestralDiscreteScheduler",
              "dpmpp_2m": "DPMSolverMultistepScheduler", "ddim": "DDIMScheduler",
              "heun": "HeunDiscreteScheduler", "pndm": "PNDMScheduler", "lms": "LMSDiscreteScheduler",
              "flow_euler": "FlowMatchEulerDiscreteScheduler"}


def make_scheduler(name: str, config: dict):
    """A diffusers scheduler by short name, configured as the model's own scheduler."""
    import diffusers

    if name not in SCHEDULERS:
        raise UserError(f"sampling.scheduler={name!r} is unknown: choose one of {', '.join(SCHEDULERS)}")
    return getattr(diffusers, SCHEDULERS[name]).from_config(config)


@dataclass
class SamplingSettings:
    """One pipeline call: its prompts and `images_per_prompt` images of each, image k of the call
    seeded `seed + k`, so that each image is what a call for it alone with its seed gives."""

    prompts: list[str]
    negative_prompt: str
    steps: int
    guidance_scale: float
    height: int
    width: int
    seed: int
    images_per_prompt: int = 1
    # A prompt longer than one CLIP window: cut to it ("truncate", as diffusers does), or encoded
    # window by window with the windows' embeddings joined into a longer context ("chunk").
    long_prompts: str = "truncate"
    # Step caching (sdquant.deep_cache.DeepCache), or None: the whole backbone at every step.
    cache: object | None = None

    @property
    def image_prompts(self) -> list[str]:
        """Each image's prompt, a prompt's images side by side, as diffusers orders them."""
        return [prompt for prompt in self.prompts for _ in range(self.images_per_prompt)]

    @property
    def seeds(self) -> list[int]:
        return [self.seed + index for index in range(len(self.image_prompts))]


# Tokens of a prompt in one CLIP window, between its start and end tokens.
WINDOW = TOKENS - 2


def prompt_windows(tokenizer, prompt: str) -> list[list[int]]:
    """The prompt's token ids as CLIP windows of TOKENS ids: start token, up to WINDOW of its tokens,
    end token, padding. At least one window; the first is what diffusers' truncation gives."""
    ids = tokenizer(prompt, add_special_tokens=False, truncation=False).input_ids
    pieces = [ids[start:start + WINDOW] for start in range(0, len(ids), WINDOW)] or [[]]
    return [[tokenizer.bos_token_id, *piece, tokenizer.eos_token_id, *[tokenizer.pad_token_id] * (WINDOW - len(piece))]
            for piece in pieces]


def dropped_words(tokenizers: list, prompt: str) -> str:
    """What cutting `prompt` to one CLIP window drops, as text; empty when it fits."""
    for tokenizer in tokenizers:
        ids = tokenizer(prompt, add_special_tokens=False, truncation=False).input_ids
        if len(ids) > WINDOW:
            return tokenizer.decode(ids[WINDOW:])
    return ""


def say_truncated(tokenizers: list, prompts: list[str], told: set[str], keep_them: str) -> int:
    """Says once per prompt (those in `told` are not said again) that a prompt is cut to CLIP's
    window and which words it loses; `keep_them` says how to keep them. Returns how many of
    `prompts` are cut."""
    cut = 0
    for prompt in dict.fromkeys(prompts):
        dropped = dropped_words(tokenizers, prompt)
        if not dropped:
            continue
        cut += 1
        if prompt not in told:
            told.add(prompt)
            shown = prompt if len(prompt) <= 60 else prompt[:57] + "..."
            print(f"warning: prompt {shown!r} is longer than CLIP's {TOKENS} tokens and is cut, dropping "
                  f"{dropped!r}; {keep_them}", file=sys.stderr, flush=True)
    return cut


class TextToImage:
    """The SDXL / SD text-to-image data flow over stages; mirrors the diffusers pipelines so the
    same prompt, seed and scheduler give the same image."""

    def __init__(self, stages: dict, tokenizers: list, scheduler, unet_config, vae_scale: int,
                 device: torch.device, sdxl: bool, force_zeros_for_empty_prompt: bool = True):
        self.stages = stages
        self.tokenizers = tokenizers
        self.scheduler = scheduler
        self.unet_config = unet_config
        self.vae_scale = vae_scale
        self.device = device
        self.sdxl = sdxl
        self.force_zeros = force_zeros_for_empty_prompt
        self.told: set[str] = set()  # the prompts already said to be cut
        self.deep: torch.Tensor | None = None  # with a step cache: the deep feature of the last full pass
        self.backbone = "unet_xl" if sdxl else "unet"
        if sdxl:
            from diffusers.models.embeddings import Timesteps

            # The Fourier features of the time ids have no weights, so they need no graph.
            self.add_time_proj = Timesteps(unet_config.addition_time_embed_dim, True, 0)

    def zero_negative(self, settings: SamplingSettings) -> bool:
        """SDXL's empty negative prompt is zeros, not encoded: the text encoders see only the prompts."""
        return self.sdxl and self.force_zeros and not settings.negative_prompt

    @staticmethod
    def guided(settings: SamplingSettings) -> bool:
        return settings.guidance_scale > 1.0

    def texts(self, settings: SamplingSettings) -> list[str]:
        """What the text encoders encode, [negative..., positive...] as the diffusers pipelines batch
        them, each prompt once (its images share its embeddings)."""
        if self.zero_negative(settings):
            return list(settings.prompts)
        return [settings.negative_prompt] * len(settings.prompts) + list(settings.prompts)

    def stage_batches(self, settings: SamplingSettings) -> dict[str, int]:
        """Samples per call of each stage with these settings, as encode and __call__ batch them,
        for checking them against the engines' profiles before any work."""
        text = len(self.texts(settings))
        images = len(settings.image_prompts)
        batches = {"clip1": text, self.backbone: 2 * images if self.guided(settings) else images,
                   "vae": images}
        if self.sdxl:
            batches["clip2"] = text
        return batches

    def context_windows(self, settings: SamplingSettings) -> int:
        """CLIP windows in the UNet's context: 1, or with long_prompts=chunk as many as the longest
        text needs (the others are padded with empty windows, so all share one length)."""
        if settings.long_prompts != "chunk":
            return 1
        return max(len(prompt_windows(tokenizer, text)) for tokenizer in self.tokenizers
                   for text in self.texts(settings))

    def sequence_sizes(self, settings: SamplingSettings) -> dict[str, int]:
        """The size of each axis of the graphs in a run besides the batch and the latent's: the UNet's
        context, and with a step cache its deep feature's height and width."""
        from .deep_cache import deep_sizes

        deep = {} if settings.cache is None else deep_sizes(*self.latent_size(settings), settings.cache.branch)
        return {CONTEXT: self.context_windows(settings) * TOKENS, **deep}

    def token_ids(self, tokenizer, settings: SamplingSettings) -> torch.Tensor:
        """(windows, texts, TOKENS) int32 token ids of the texts, each padded to the same windows."""
        windows = self.context_windows(settings)
        empty = prompt_windows(tokenizer, "")
        ids = [(prompt_windows(tokenizer, text) + empty * windows)[:windows] for text in self.texts(settings)]
        return torch.tensor(ids, dtype=torch.int32).transpose(0, 1)

    def encode(self, settings: SamplingSettings, timer: StageTimer):
        """The context (each CLIP window's hidden states, joined along the sequence) and pooled
        embedding (the first window's) of [negative..., positive...], one per image."""
        if settings.long_prompts != "chunk":
            say_truncated(self.tokenizers, self.texts(settings), self.told, "sampling.long_prompts=chunk keeps them")
        token_ids = [self.token_ids(tokenizer, settings).to(self.device) for tokenizer in self.tokenizers]
        windows, pooled = [], None
        for window in range(token_ids[0].shape[0]):
            hidden = [timer.time("clip1", self.stages["clip1"], input_ids=token_ids[0][window])["hidden_states"]]
            if self.sdxl:
                second = timer.time("clip2", self.stages["clip2"], input_ids=token_ids[1][window])
                hidden.append(second["hidden_states"])
                pooled = second["pooled"] if pooled is None else pooled
            windows.append(torch.cat(hidden, dim=-1))
        context = torch.cat(windows, dim=1)
        if self.zero_negative(settings):
            context = torch.cat([torch.zeros_like(context), context])
            pooled = torch.cat([torch.zeros_like(pooled), pooled])
        repeat = settings.images_per_prompt
        return context.repeat_interleave(repeat, 0), None if pooled is None else pooled.repeat_interleave(repeat, 0)

    def y(self, pooled: torch.Tensor, height: int, width: int) -> torch.Tensor:
        time_ids = torch.tensor([[height, width, 0, 0, height, width]], dtype=torch.float32,
                                device=pooled.device).repeat(pooled.shape[0], 1)
        fourier = self.add_time_proj(time_ids.flatten()).reshape(pooled.shape[0], -1)
        return torch.cat([pooled, fourier.to(pooled.dtype)], dim=-1)

    def generators(self, settings: SamplingSettings) -> list[torch.Generator]:
        """One generator per image, seeded with its own seed, as diffusers takes a list of them."""
        return [torch.Generator(device=self.device).manual_seed(seed) for seed in settings.seeds]

    def latent_size(self, settings: SamplingSettings) -> tuple[int, int]:
        return settings.height // self.vae_scale, settings.width // self.vae_scale

    def initial_latents(self, settings: SamplingSettings, generators: list | None = None) -> torch.Tensor:
        from diffusers.utils.torch_utils import randn_tensor

        shape = (len(settings.image_prompts), self.unet_config.in_channels, *self.latent_size(settings))
        generators = generators or self.generators(settings)
        return randn_tensor(shape, generator=generators, device=self.device, dtype=torch.float32)

    def _step_kwargs(self, generators: list) -> dict:
        # Ancestral and SDE schedulers draw fresh noise at each step: drawn from each image's own
        # generator, as the diffusers pipelines do, the same seed gives the same image.
        import inspect

        return {"generator": generators} if "generator" in inspect.signature(self.scheduler.step).parameters else {}

    def predict(self, settings: SamplingSettings, step: int, inputs: dict, timer: StageTimer) -> torch.Tensor:
        """The backbone's output at this step: the whole UNet, or with a step cache its full pass
        (which also gives the deep feature to keep) or its shallow pass (which takes it)."""
        from .deep_cache import DEEP, FULL, SHALLOW

        cache = settings.cache
        if cache is None:
            return timer.time(self.backbone, self.stages[self.backbone], **inputs)["out"]
        if cache.full_step(step):
            outputs = timer.time(self.backbone, self.stages[FULL.format(self.backbone)], **inputs)
            self.deep = outputs[DEEP]
            return outputs["out"]
        return timer.time(self.backbone, self.stages[SHALLOW.format(self.backbone)], **inputs, deep=self.deep)["out"]

    def __call__(self, settings: SamplingSettings, timer: StageTimer, progress: bool = True,
                 latents: torch.Tensor | None = None) -> torch.Tensor:
        """Images in [0, 1], (B, 3, H, W), float32."""
        context, pooled = self.encode(settings, timer)
        y = self.y(pooled, settings.height, settings.width) if self.sdxl else None
        self.scheduler.set_timesteps(settings.steps, device=self.device)
        generators = self.generators(settings)
        latents = self.initial_latents(settings, generators) if latents is None else latents
        latents = latents * self.scheduler.init_noise_sigma
        step_kwargs = self._step_kwargs(generators)
        guided = self.guided(settings)
        steps = Progress(self.scheduler.timesteps, "denoising", "steps", show=progress, leave=False)
        for step, t in enumerate(steps):
            x = torch.cat([latents] * 2) if guided else latents
            x = self.scheduler.scale_model_input(x, t)
            inputs = {"x": x, "timesteps": t.float().expand(x.shape[0]),
                      "context": context if guided else context[context.shape[0] // 2:]}
            if y is not None:
                inputs["y"] = y if guided else y[y.shape[0] // 2:]
            noise = self.predict(settings, step, inputs, timer).float()
            if guided:
                uncond, cond = noise.chunk(2)
                noise = uncond + settings.guidance_scale * (cond - uncond)
            latents = self.scheduler.step(noise, t, latents, **step_kwargs, return_dict=False)[0]
        images = timer.time("vae", self.stages["vae"], latent=latents)["images"].float()
        warn_if_not_finite(latents, images)
        return (images / 2 + 0.5).clamp(0, 1)


def warn_if_not_finite(latents: torch.Tensor, images: torch.Tensor) -> None:
    """Names the stage that produced NaN or inf; read once, after the run, so the loop never waits."""
    if not torch.isfinite(latents).all():
        warnings.warn("the UNet produced NaN or inf latents: check the quantized checkpoint's ranges")
    elif not torch.isfinite(images).all():
        warnings.warn("the VAE produced NaN or inf pixels: an fp16 VAE overflowing is the usual cause; "
                      "export it with onnx.vae_precision=fp32")

