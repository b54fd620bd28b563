"""Training stage: the built-in scene model, an SDXL-architecture pipeline trained from scratch on
captioned scenes (``sdquant.scenes``) with diffusers' and transformers' own classes.

Two phases, as latent diffusion is trained: first the AutoencoderKL on the images alone, until its
reconstructions keep every attribute; then the UNet and both CLIP text encoders together on the
autoencoder's clean latents (the posterior mode, so the UNet's target carries no posterior noise),
with the standard noise-prediction loss and a diffusers DDPM noise schedule. A tenth of the
captions are dropped to zeros, which is what the SDXL pipeline feeds for an empty negative prompt,
so classifier-free guidance works at sampling time. The result is saved with ``save_pretrained``
in fp16 and loads like any SDXL folder.
"""

from __future__ import annotations

import json
import math
import string
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from . import scenes
from .artifacts import atomic_folder
from .cli import stage
from .errors import UserError
from .progress import Progress
from .report import library_versions

TRAINING_RECORD = "training.json"
LOSS_LOG = "loss_log.csv"
CALIBRATION_PROMPTS = "calib_prompts.txt"
HELD_OUT_PROMPTS = "heldout_prompts.txt"
# SDXL's own noise schedule and time ids convention (original size, crop, target size).
SCHEDULE = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000)
TIME_ID_WIDTH = 8


def scene_tokenizer():
    """A CLIP tokenizer whose merges spell every caption word as one token; any other word still
    encodes, letter by letter."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import CLIPTokenizer

    alphabet = list(string.ascii_lowercase + string.digits + ",.!?'-")
    bpe = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=1000, initial_alphabet=alphabet, end_of_word_suffix="</w>",
                                  show_progress=False)
    bpe.train_from_iterator([" ".join(scenes.caption_vocabulary())] * 4, trainer)
    learned = json.loads(bpe.to_str())["model"]
    vocab = dict(learned["vocab"])
    for piece in alphabet + [letter + "</w>" for letter in alphabet]:
        vocab.setdefault(piece, len(vocab))
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[tuple(pair) for pair in learned["merges"]], model_max_length=77)


def build_pipeline(arch, tokenizer):
    """The untrained scene pipeline: SDXL's layout at the widths `arch` gives."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    vocab_size = len(tokenizer)
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)

    def text_config(width: int) -> CLIPTextConfig:
        return CLIPTextConfig(vocab_size=vocab_size, hidden_size=width, intermediate_size=4 * width,
                              num_attention_heads=max(1, width // 32), num_hidden_layers=arch.text_layers,
                              max_position_embeddings=77, projection_dim=width, hidden_act="gelu", **ids)

    depth = len(arch.vae_channels)
    vae = AutoencoderKL(block_out_channels=tuple(arch.vae_channels),
                        down_block_types=("DownEncoderBlock2D",) * depth, up_block_types=("UpDecoderBlock2D",) * depth,
                        latent_channels=4, norm_num_groups=arch.norm_groups, layers_per_block=arch.vae_layers,
                        sample_size=scenes.IMAGE_SIZE, force_upcast=False)
    latent_size = scenes.IMAGE_SIZE // 2 ** (depth - 1)
    text_widths = tuple(arch.text_widths)
    unet = UNet2DConditionModel(
        sample_size=latent_size, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=tuple(arch.unet_channels),
        down_block_types=("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (len(arch.unet_channels) - 1),
        up_block_types=("CrossAttnUpBlock2D",) * (len(arch.unet_channels) - 1) + ("UpBlock2D",),
        attention_head_dim=tuple(channels // 32 for channels in arch.unet_channels),
        cross_attention_dim=sum(text_widths), transformer_layers_per_block=1, use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=TIME_ID_WIDTH,
        projection_class_embeddings_input_dim=6 * TIME_ID_WIDTH + text_widths[1], norm_num_groups=arch.norm_groups)
    scheduler = EulerDiscreteScheduler(**SCHEDULE, timestep_spacing="leading", steps_offset=1)
    return StableDiffusionXLPipeline(
        vae=vae, text_encoder=CLIPTextModel(text_config(text_widths[0])),
        text_encoder_2=CLIPTextModelWithProjection(text_config(text_widths[1])), tokenizer=tokenizer,
        tokenizer_2=tokenizer, unet=unet, scheduler=scheduler, add_watermarker=False)


@dataclass
class Dataset:
    """Rendered training scenes on the training device: pixels in [-1, 1] and both token ids."""

    pixels: torch.Tensor     # (N, 3, 64, 64) uint8
    token_ids: torch.Tensor  # (N, 77) int64

    def batch(self, indices: torch.Tensor) -> torch.Tensor:
        return self.pixels[indices].float() / 127.5 - 1


def make_dataset(size: int, seed: int, tokenizer, device: torch.device) -> Dataset:
    chosen = scenes.sample(size, seed)
    pixels = torch.from_numpy(scenes.render(chosen, seed=seed)).permute(0, 3, 1, 2).contiguous()
    token_ids = tokenizer([scene.caption() for scene in chosen], padding="max_length", max_length=77,
                          truncation=True, return_tensors="pt").input_ids
    return Dataset(pixels.to(device), token_ids.to(device))


class LossLog:
    """Per phase and step, the loss, written once at the end as CSV."""

    def __init__(self):
        self.rows: list[tuple[str, int, float]] = []

    def add(self, phase: str, step: int, loss: float) -> None:
        self.rows.append((phase, step, loss))

    def final(self, phase: str, last: int = 100) -> float:
        values = [loss for name, _, loss in self.rows if name == phase][-last:]
        return float(np.mean(values)) if values else math.nan

    def write(self, path: Path) -> None:
        path.write_text("phase,step,loss\n" + "".join(f"{p},{s},{v:.6f}\n" for p, s, v in self.rows))


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def _every(step: int, total: int) -> bool:
    """Whether to read the loss back this step: often enough for a curve, rarely enough that the
    GPU never waits on the host."""
    return step % 25 == 0 or step == total


def train_vae(vae, data: Dataset, block, generator: torch.Generator, log: LossLog) -> None:
    device = data.pixels.device
    vae.train()
    optimizer = torch.optim.AdamW(vae.parameters(), lr=block.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, block.learning_rate, total_steps=block.steps,
                                                   pct_start=0.05)
    bar = Progress(range(1, block.steps + 1), "vae", "steps")
    for step in bar:
        pixels = data.batch(torch.randint(len(data.pixels), (block.batch_size,), device=device, generator=generator))
        with _autocast(device):
            posterior = vae.encode(pixels).latent_dist
            reconstruction = vae.decode(posterior.sample(generator)).sample
        loss = F.mse_loss(reconstruction.float(), pixels) + block.kl_weight * posterior.kl().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if _every(step, block.steps):
            log.add("vae", step, loss.item())
            bar.note(loss=f"{log.rows[-1][2]:.4f}")
    vae.eval()


@torch.no_grad()
def encode_latents(vae, data: Dataset, chunk: int = 1024) -> torch.Tensor:
    """Every training image's posterior mode; also sets the VAE's scaling factor so the scaled
    latents have unit variance, as Stable Diffusion's factor does for its VAE."""
    latents = torch.cat([vae.encode(data.batch(torch.arange(i, min(i + chunk, len(data.pixels)),
                                                            device=data.pixels.device))).latent_dist.mode()
                         for i in range(0, len(data.pixels), chunk)])
    vae.register_to_config(scaling_factor=float(1 / latents.std()))
    return latents * vae.config.scaling_factor


def text_conditioning(pipe, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SDXL's conditioning: both encoders' penultimate hidden states side by side, and the second
    encoder's projected pooled output."""
    first = pipe.text_encoder(token_ids, output_hidden_states=True)
    second = pipe.text_encoder_2(token_ids, output_hidden_states=True)
    context = torch.cat([first.hidden_states[-2], second.hidden_states[-2]], dim=-1)
    return context, second.text_embeds


def train_denoiser(pipe, latents: torch.Tensor, data: Dataset, block, generator: torch.Generator,
                   log: LossLog) -> None:
    """UNet and both text encoders together, with an exponential moving average of their weights
    copied in at the end."""
    from diffusers import DDPMScheduler
    from diffusers.training_utils import EMAModel

    device = latents.device
    noise_schedule = DDPMScheduler(**SCHEDULE)
    modules = [pipe.unet, pipe.text_encoder, pipe.text_encoder_2]
    parameters = [p for module in modules for p in module.parameters()]
    for module in modules:
        module.train()
    optimizer = torch.optim.AdamW(parameters, lr=block.learning_rate, weight_decay=1e-2)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, block.learning_rate, total_steps=block.steps,
                                                   pct_start=0.05)
    ema = EMAModel(parameters, decay=block.ema_decay, use_ema_warmup=True, foreach=True)
    size = scenes.IMAGE_SIZE
    time_ids = torch.tensor([[size, size, 0, 0, size, size]], dtype=torch.float32, device=device)
    bar = Progress(range(1, block.steps + 1), "unet", "steps")
    for step in bar:
        indices = torch.randint(len(latents), (block.batch_size,), device=device, generator=generator)
        clean = latents[indices]
        noise = torch.randn(clean.shape, device=device, generator=generator)
        timesteps = torch.randint(noise_schedule.config.num_train_timesteps, (block.batch_size,), device=device,
                                  generator=generator)
        keep = (torch.rand(block.batch_size, device=device, generator=generator) >= block.empty_caption_rate).float()
        with _autocast(device):
            context, pooled = text_conditioning(pipe, data.token_ids[indices])
            prediction = pipe.unet(noise_schedule.add_noise(clean, noise, timesteps), timesteps,
                                   context * keep[:, None, None],
                                   added_cond_kwargs={"text_embeds": pooled * keep[:, None],
                                                      "time_ids": time_ids.expand(block.batch_size, -1)}).sample
        loss = F.mse_loss(prediction.float(), noise)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        schedule.step()
        ema.step(parameters)
        if _every(step, block.steps):
            log.add("unet", step, loss.item())
            bar.note(loss=f"{log.rows[-1][2]:.4f}")
    ema.copy_to(parameters)
    for module in modules:
        module.eval()


@torch.no_grad()
def held_out_adherence(pipe, prompts: list[str], steps: int, guidance_scale: float, seed: int) -> dict:
    """The trained pipeline's prompt adherence on held-out scenes, with diffusers' own sampler."""
    from .quality import adherence, adherence_summary

    rows = []
    batch = 16
    for start in range(0, len(prompts), batch):
        chunk = prompts[start:start + batch]
        generator = torch.Generator(pipe.device).manual_seed(seed + start)
        images = pipe(chunk, num_inference_steps=steps, guidance_scale=guidance_scale, output_type="pt",
                      height=scenes.IMAGE_SIZE, width=scenes.IMAGE_SIZE, generator=generator).images
        rows += adherence(images.float(), chunk)
    return adherence_summary(rows)["mean"]


def held_out_prompts(count: int) -> list[str]:
    return [scene.caption() for scene in scenes.sample(count, scenes.HELD_OUT_SEED, held_out=True)]


def train_scene_model(cfg, device: torch.device) -> tuple[Path, dict]:
    """Trains the scene pipeline and saves it (fp16, safetensors) to cfg.out_dir; returns the
    folder and the training record, which is also written into it."""
    out = Path(cfg.out_dir).expanduser()
    if out.exists() and not cfg.force:
        raise UserError(f"out_dir={out} exists: choose another folder or set force=true to replace it")
    started = time.perf_counter()
    torch.manual_seed(cfg.seed)
    generator = torch.Generator(device).manual_seed(cfg.seed)
    tokenizer = scene_tokenizer()
    pipe = build_pipeline(cfg.architecture, tokenizer).to(device)
    data = make_dataset(cfg.dataset_size, cfg.seed, tokenizer, device)
    log = LossLog()
    seconds = {}

    phase_start = time.perf_counter()
    with stage("the VAE's training"):
        train_vae(pipe.vae, data, cfg.vae, generator, log)
        latents = encode_latents(pipe.vae, data)
    seconds["vae"] = time.perf_counter() - phase_start

    phase_start = time.perf_counter()
    with stage("the UNet's training"):
        train_denoiser(pipe, latents, data, cfg.unet, generator, log)
    seconds["unet"] = time.perf_counter() - phase_start

    # What ships is the fp16 pipeline, so that is what gets scored.
    pipe.to(torch.float16).set_progress_bar_config(disable=True)
    prompts = held_out_prompts(cfg.eval_prompts)
    with stage("scoring the held-out prompts"):
        adherence = held_out_adherence(pipe, prompts, cfg.eval_steps, cfg.guidance_scale, cfg.seed) if prompts else {}
    record = {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "seconds": {key: round(value, 1) for key, value in seconds.items()},
        "final_loss": {"vae": log.final("vae"), "unet": log.final("unet")},
        "parameters": {name: sum(p.numel() for p in getattr(pipe, name).parameters())
                       for name in ("unet", "vae", "text_encoder", "text_encoder_2")},
        "held_out_adherence": {"prompts": len(prompts), "steps": cfg.eval_steps,
                               "guidance_scale": cfg.guidance_scale, **adherence},
        "held_out_combinations": sorted(map(list, scenes.held_out_combinations())),
        "versions": library_versions(),
    }
    with stage(f"saving the model to {out}"):
        save(pipe, out, record, log)
    record["seconds"]["total"] = round(time.perf_counter() - started, 1)
    return out, record


def save(pipe, out: Path, record: dict, log: LossLog) -> None:
    """Writes the whole folder under a temporary name and renames it when complete."""
    with atomic_folder(out) as staging:
        pipe.save_pretrained(staging, safe_serialization=True)
        (staging / TRAINING_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        log.write(staging / LOSS_LOG)
        (staging / CALIBRATION_PROMPTS).write_text(
            "\n".join(scene.caption() for scene in scenes.sample(256, seed=1)) + "\n")
        (staging / HELD_OUT_PROMPTS).write_text("\n".join(held_out_prompts(64)) + "\n")
