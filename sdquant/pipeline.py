"""The text-to-image pipeline: the SDXL / SD data flow of the diffusers pipelines (encode the
prompts, denoise with a diffusers scheduler and classifier-free guidance, decode), run over
stages (sdquant.stages), so one loop drives the TensorRT engines, the ONNX files and the
diffusers modules alike.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .errors import UserError
from .networks import unet_graph_name
from .progress import Progress
from .stages import StageTimer

SCHEDULERS = {"euler": "EulerDiscreteScheduler", "euler_a": "EulerAncestralDiscreteScheduler",
              "dpmpp_2m": "DPMSolverMultistepScheduler", "ddim": "DDIMScheduler",
              "heun": "HeunDiscreteScheduler", "pndm": "PNDMScheduler", "lms": "LMSDiscreteScheduler"}


def make_scheduler(name: str, config: dict):
    """A diffusers scheduler by short name, configured as the model's own scheduler."""
    import diffusers

    if name not in SCHEDULERS:
        raise UserError(f"sampling.scheduler={name!r} is unknown: choose one of {', '.join(SCHEDULERS)}")
    return getattr(diffusers, SCHEDULERS[name]).from_config(config)


@dataclass
class SamplingSettings:
    prompts: list[str]
    negative_prompt: str
    steps: int
    guidance_scale: float
    height: int
    width: int
    seed: int


def tokenize(tokenizer, prompts: list[str]) -> torch.Tensor:
    return tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length,
                     truncation=True, return_tensors="pt").input_ids.to(torch.int32)


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

    def stage_batches(self, settings: SamplingSettings) -> dict[str, int]:
        """Samples per call of each stage with these settings, as encode and __call__ batch them,
        for checking them against the engines' profiles before any work."""
        images = len(settings.prompts)
        text = images if self.zero_negative(settings) else 2 * images
        batches = {"clip1": text, unet_graph_name(self.sdxl): 2 * images if self.guided(settings) else images,
                   "vae": images}
        if self.sdxl:
            batches["clip2"] = text
        return batches

    def encode(self, settings: SamplingSettings, timer: StageTimer):
        """Embeddings for [negative..., positive...], as the diffusers pipelines batch them."""
        batch = len(settings.prompts)
        zero_negative = self.zero_negative(settings)
        texts = settings.prompts if zero_negative else [settings.negative_prompt] * batch + settings.prompts
        hidden = [timer.time("clip1", self.stages["clip1"],
                             input_ids=tokenize(self.tokenizers[0], texts).to(self.device))["hidden_states"]]
        pooled = None
        if self.sdxl:
            second = timer.time("clip2", self.stages["clip2"],
                                input_ids=tokenize(self.tokenizers[1], texts).to(self.device))
            hidden.append(second["hidden_states"])
            pooled = second["pooled"]
        context = torch.cat(hidden, dim=-1)
        if zero_negative:
            context = torch.cat([torch.zeros_like(context), context])
            pooled = torch.cat([torch.zeros_like(pooled), pooled])
        return context, pooled

    def y(self, pooled: torch.Tensor, height: int, width: int) -> torch.Tensor:
        time_ids = torch.tensor([[height, width, 0, 0, height, width]], dtype=torch.float32,
                                device=pooled.device).repeat(pooled.shape[0], 1)
        fourier = self.add_time_proj(time_ids.flatten()).reshape(pooled.shape[0], -1)
        return torch.cat([pooled, fourier.to(pooled.dtype)], dim=-1)

    def generator(self, settings: SamplingSettings) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(settings.seed)

    def initial_latents(self, settings: SamplingSettings, generator: torch.Generator | None = None) -> torch.Tensor:
        from diffusers.utils.torch_utils import randn_tensor

        shape = (len(settings.prompts), self.unet_config.in_channels,
                 settings.height // self.vae_scale, settings.width // self.vae_scale)
        generator = generator or self.generator(settings)
        return randn_tensor(shape, generator=generator, device=self.device, dtype=torch.float32)

    def _step_kwargs(self, generator: torch.Generator) -> dict:
        # Ancestral and SDE schedulers draw fresh noise at each step: drawn from the run's own
        # generator, as the diffusers pipelines do, the same seed gives the same image.
        import inspect

        return {"generator": generator} if "generator" in inspect.signature(self.scheduler.step).parameters else {}

    def __call__(self, settings: SamplingSettings, timer: StageTimer, progress: bool = True,
                 latents: torch.Tensor | None = None) -> torch.Tensor:
        """Images in [0, 1], (B, 3, H, W), float32."""
        context, pooled = self.encode(settings, timer)
        y = self.y(pooled, settings.height, settings.width) if self.sdxl else None
        self.scheduler.set_timesteps(settings.steps, device=self.device)
        generator = self.generator(settings)
        latents = self.initial_latents(settings, generator) if latents is None else latents
        latents = latents * self.scheduler.init_noise_sigma
        step_kwargs = self._step_kwargs(generator)
        unet_name = unet_graph_name(self.sdxl)
        guided = self.guided(settings)
        steps = Progress(self.scheduler.timesteps, "denoising", "steps", show=progress, leave=False)
        for t in steps:
            x = torch.cat([latents] * 2) if guided else latents
            x = self.scheduler.scale_model_input(x, t)
            inputs = {"x": x, "timesteps": t.float().expand(x.shape[0]),
                      "context": context if guided else context[context.shape[0] // 2:]}
            if y is not None:
                inputs["y"] = y if guided else y[y.shape[0] // 2:]
            noise = timer.time(unet_name, self.stages[unet_name], **inputs)["out"].float()
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

