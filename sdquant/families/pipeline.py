"""What every family's text-to-image data flow shares: the settings of one pipeline call, the
scheduler by name, CLIP's prompt windows, and the base of the data flows (one generator per image,
the initial latents, decoding with the finite check). Each family's own flow, read top to bottom
like a diffusers pipeline's __call__, lives in its module and runs over stages (sdquant.runtime.stages),
so one loop drives the TensorRT engines, the ONNX files and the diffusers modules alike.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import UserError
from ..graphs.geometry import SampleGeometry
from ..graphs.networks import TOKENS

if TYPE_CHECKING:
    from ..runtime.stages import StageTimer

SCHEDULERS = {"euler": "EulerDiscreteScheduler", "euler_a": "EulerAncestralDiscreteScheduler",
              "dpmpp_2m": "DPMSolverMultistepScheduler", "ddim": "DDIMScheduler",
              "heun": "HeunDiscreteScheduler", "pndm": "PNDMScheduler", "lms": "LMSDiscreteScheduler",
              "flow_euler": "FlowMatchEulerDiscreteScheduler", "unipc": "UniPCMultistepScheduler"}
# Those that draw fresh noise at every step from the call's per-image generators, seeded by its
# seeds: an image drawn in a call of other requests' images would take other noise.
NOISY_SCHEDULERS = ("euler_a",)


def make_scheduler(name: str, config: dict):
    """A diffusers scheduler by short name, configured as the model's own scheduler."""
    import diffusers

    if name not in SCHEDULERS:
        raise UserError(f"sampling.scheduler={name!r} is unknown: choose one of {', '.join(SCHEDULERS)}")
    return getattr(diffusers, SCHEDULERS[name]).from_config(config)


@dataclass
class SamplingSettings:
    """One pipeline call: its prompts and `images_per_prompt` images (or videos) of each, image k of
    the call seeded `seed + k`, so that each image is what a call for it alone with its seed gives."""

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
    # The family's step cache (DeepCache, a diffusers cache hook), or None: the whole backbone at
    # every step.
    cache: object | None = None
    # A video's frames (1: an image), its frame rate in the written file, and a two-expert model's
    # guidance for its second expert (None: guidance_scale).
    frames: int = 1
    fps: int | None = None
    guidance_scale_2: float | None = None

    @property
    def geometry(self) -> SampleGeometry:
        return SampleGeometry(self.frames, self.height, self.width)

    @property
    def image_prompts(self) -> list[str]:
        """Each image's prompt, a prompt's images side by side, as diffusers orders them."""
        return [prompt for prompt in self.prompts for _ in range(self.images_per_prompt)]

    @property
    def seeds(self) -> list[int]:
        return [self.seed + index for index in range(len(self.image_prompts))]

    @property
    def guided(self) -> bool:
        """Classifier-free guidance, as diffusers' pipelines decide it."""
        return self.guidance_scale > 1.0


# Tokens of a prompt in one CLIP window, between its start and end tokens.
WINDOW = TOKENS - 2


def prompt_windows(tokenizer, prompt: str) -> list[list[int]]:
    """The prompt's token ids as CLIP windows of TOKENS ids: start token, up to WINDOW of its tokens,
    end token, padding. At least one window; the first is what diffusers' truncation gives."""
    ids = tokenizer(prompt, add_special_tokens=False, truncation=False).input_ids
    pieces = [ids[start:start + WINDOW] for start in range(0, len(ids), WINDOW)] or [[]]
    return [[tokenizer.bos_token_id, *piece, tokenizer.eos_token_id, *[tokenizer.pad_token_id] * (WINDOW - len(piece))]
            for piece in pieces]


def padded_ids(tokenizer, texts: list[str], length: int, device: torch.device) -> torch.Tensor:
    """(texts, length) int32 token ids, each text cut or padded to `length` with the tokenizer's own
    start and end tokens, as diffusers' DiT pipelines tokenize for CLIP and T5."""
    ids = tokenizer(texts, padding="max_length", max_length=length, truncation=True, return_tensors="pt").input_ids
    return ids.to(device=device, dtype=torch.int32)


def dropped_words(tokenizers: list, prompt: str) -> str:
    """What cutting `prompt` to one CLIP window drops, as text; empty when it fits."""
    for tokenizer in tokenizers:
        ids = tokenizer(prompt, add_special_tokens=False, truncation=False).input_ids
        if len(ids) > WINDOW:
            return tokenizer.decode(ids[WINDOW:])
    return ""


def t5_dropped_words(tokenizer, text: str, length: int) -> str:
    """What cutting `text` to T5's `length` tokens (its end token included) drops, as text; empty
    when it fits."""
    ids = tokenizer(text, truncation=False).input_ids
    return tokenizer.decode(ids[length - 1:], skip_special_tokens=True) if len(ids) > length else ""


def shortened(prompt: str) -> str:
    """A prompt as a warning shows it: up to 60 characters."""
    return prompt if len(prompt) <= 60 else prompt[:57] + "..."


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
            print(f"warning: prompt {shortened(prompt)!r} is longer than CLIP's {TOKENS} tokens and is cut, dropping "
                  f"{dropped!r}; {keep_them}", file=sys.stderr, flush=True)
    return cut


class TextToImage:
    """The base of every family's data flow over stages: the parts each family's __call__ shares.

    A family's subclass names its backbone stage (`backbone`; a flow of several backbones, each
    expert's, names them all in `backbones`), says what each stage sees per call (`stage_batches`)
    and how large each dynamic axis is in a run (`axis_sizes`), and draws the latents it denoises
    (`latent_shape`)."""

    backbone: str

    @property
    def backbones(self) -> tuple[str, ...]:
        """The stages that run a backbone at each step: one, or each expert's."""
        return (self.backbone,)

    def __init__(self, stages: dict, tokenizers: list, scheduler, backbone_config, vae_scale: int,
                 device: torch.device):
        self.stages = stages
        self.tokenizers = tokenizers
        self.scheduler = scheduler
        self.backbone_config = backbone_config
        self.vae_scale = vae_scale
        self.device = device
        self.told: set[str] = set()  # the prompts already said to be cut

    def stage_batches(self, settings: SamplingSettings) -> dict[str, int]:
        """Samples per call of each stage, for checking them against the engines' profiles."""
        raise NotImplementedError

    def step_modulations(self, timesteps: torch.Tensor, inputs: dict[str, torch.Tensor], timer) -> torch.Tensor | None:
        """(steps, rows, width): every step's AdaLN modulations at once, where the stages precompute
        them (the compiled torch backend, sdquant.runtime.step_modulations), which the backbone then
        takes in place of the pooled text; None where it computes them itself. `timesteps`: (steps,
        rows), each row's timestep as the backbone takes it; `inputs`: the embedding's other inputs,
        by row, the same at every step. Timed as the backbone's, whose work it is."""
        from ..runtime.step_modulations import MODULATIONS

        stage = self.stages.get(MODULATIONS)
        if stage is None:
            return None
        steps, rows = timesteps.shape
        repeated = {name: tensor.repeat(steps, *[1] * (tensor.dim() - 1)) for name, tensor in inputs.items()}
        modulations = timer.time(self.backbone, stage, timestep=timesteps.flatten(), **repeated)[MODULATIONS]
        return modulations.unflatten(0, (steps, rows))

    def words_lost(self, text: str) -> tuple[str, str]:
        """(the limit, the words past it) where the family's text encoders lose words of `text`
        that no other encoder of the pipeline reads; ("", "") where nothing is lost."""
        raise NotImplementedError

    def refuse_cut_prompts(self, runs: list[SamplingSettings]) -> None:
        """sampling.long_prompts=error: refuses, in one line and before any work, the first prompt
        (or negative prompt) whose words the text encoders would lose."""
        for settings in runs:
            for text in dict.fromkeys([settings.negative_prompt, *settings.prompts]):
                limit, dropped = self.words_lost(text)
                if dropped:
                    raise UserError(f"sampling.long_prompts=error: prompt {shortened(text)!r} is longer than {limit} "
                                    f"and would lose {dropped!r}: shorten it, or set sampling.long_prompts=truncate")

    def axis_sizes(self, settings: SamplingSettings) -> dict[str, int]:
        """The size of every dynamic axis but the batch in a run with these settings."""
        raise NotImplementedError

    def latent_size(self, settings: SamplingSettings) -> tuple[int, int]:
        return settings.height // self.vae_scale, settings.width // self.vae_scale

    def latent_shape(self, settings: SamplingSettings) -> tuple[int, ...]:
        raise NotImplementedError

    # The dtype diffusers draws the initial noise in for this family.
    latent_dtype = torch.float32

    def generators(self, settings: SamplingSettings) -> list[torch.Generator]:
        """One generator per image, seeded with its own seed, as diffusers takes a list of them."""
        return [torch.Generator(device=self.device).manual_seed(seed) for seed in settings.seeds]

    def initial_latents(self, settings: SamplingSettings, generators: list | None = None) -> torch.Tensor:
        """The noise diffusers draws: per image from its own generator."""
        from diffusers.utils.torch_utils import randn_tensor

        generators = generators or self.generators(settings)
        return randn_tensor(self.latent_shape(settings), generator=generators, device=self.device,
                            dtype=self.latent_dtype)

    def scheduler_step_kwargs(self, generators: list) -> dict:
        """Ancestral and SDE schedulers draw fresh noise at each step: drawn from each image's own
        generator, as the diffusers pipelines do, the same seed gives the same image."""
        return {"generator": generators} if "generator" in inspect.signature(self.scheduler.step).parameters else {}

    def decode(self, latents: torch.Tensor, timer: StageTimer) -> torch.Tensor:
        """Images in [0, 1], (B, 3, H, W), float32, from the final latents."""
        images = timer.time("vae", self.stages["vae"], latent=latents)["images"].float()
        warn_if_not_finite(latents, images)
        return (images / 2 + 0.5).clamp(0, 1)

    def predict(self, settings: SamplingSettings, step: int, inputs: dict, timer: StageTimer) -> torch.Tensor:
        """The backbone's prediction at this step on `inputs` (its graph's inputs by name)."""
        raise NotImplementedError

    def __call__(self, settings: SamplingSettings, timer: StageTimer, progress: bool = True,
                 latents: torch.Tensor | None = None) -> torch.Tensor:
        """Images in [0, 1], (B, 3, H, W), float32; `latents`: the initial noise, else drawn."""
        raise NotImplementedError


def warn_if_not_finite(latents: torch.Tensor, images: torch.Tensor) -> None:
    """Names the stage that produced NaN or inf; read once, after the run, so the loop never waits."""
    if not torch.isfinite(latents).all():
        warnings.warn("the backbone produced NaN or inf latents: check the quantized checkpoint's ranges")
    elif not torch.isfinite(images).all():
        warnings.warn("the VAE produced NaN or inf pixels: an fp16 VAE overflowing is the usual cause; decode "
                      "in bf16 or fp32 (model.vae_dtype, onnx.vae_precision=fp32) or give an fp16-safe VAE "
                      "(model.vae_source)")
