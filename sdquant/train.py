"""Training stage: the built-in scene models, an SDXL-architecture and a Flux-architecture pipeline
trained from scratch on captioned scenes of one and two objects (``sdquant.scenes``) with
diffusers' and transformers' own classes.

Two phases, as latent diffusion is trained: first the AutoencoderKL on the images alone, until its
reconstructions keep every attribute; then the denoiser and its text encoders together on the
autoencoder's clean latents (the posterior mode, so the target carries no posterior noise). The
SDXL UNet learns to predict noise under a DDPM schedule, with a tenth of the captions dropped to
zeros, what the SDXL pipeline feeds for an empty negative prompt, so classifier-free guidance
works at sampling time. The Flux transformer learns the flow-matching velocity (noise minus
image) at logit-normal noise levels, as diffusers' Flux training scripts do, and samples with
Flux.1's own scheduler. Each result is saved with ``save_pretrained`` in fp16 and loads like any
SDXL or Flux folder.
"""

from __future__ import annotations

import json
import math
import string
import time
from collections.abc import Callable
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
from .families import family_of
from .progress import Progress
from .report import library_versions

TRAINING_RECORD = "training.json"
LOSS_LOG = "loss_log.csv"
CALIBRATION_PROMPTS = "calib_prompts.txt"
HELD_OUT_PROMPTS = "heldout_prompts.txt"
# SDXL's own noise schedule and time ids convention (original size, crop, target size).
SCHEDULE = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000)
TIME_ID_WIDTH = 8
# The Flux scene model's T5 sequence: its longest caption is 17 pieces with the end token. The
# pipelines take the length from the saved tokenizer; diffusers' 512 would make nine tenths of
# every training step and every sampling step padding.
SCENE_TEXT_TOKENS = 32


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


def scene_t5_tokenizer():
    """A T5 tokenizer (SentencePiece-style unigram) with every caption word as one piece; any other
    word still encodes, letter by letter. It saves and loads as T5's own."""
    from transformers import T5TokenizerFast

    letters = list(string.ascii_letters + string.digits + string.punctuation)
    words = [("\u2581" + word, 0.0) for word in scenes.caption_vocabulary() if word.isalnum()]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -5.0), *words,
             *[(letter, -10.0) for letter in letters]]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=SCENE_TEXT_TOKENS)


def build_sdxl_scenes(arch, tokenizer):
    """The untrained SDXL scene pipeline: SDXL's layout at the widths `arch` gives."""
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


def build_flux_scenes(arch, clip_tokenizer, t5_tokenizer):
    """The untrained Flux scene pipeline: Flux.1's layout (CLIP's pooled output and T5's hidden
    states, double- then single-stream blocks, a 16-channel AutoencoderKL, the flow-matching
    scheduler with dynamic shifting) at the sizes `arch` gives, without the guidance embedding."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(clip_tokenizer), hidden_size=arch.clip_width, intermediate_size=4 * arch.clip_width,
        num_attention_heads=max(1, arch.clip_width // 32), num_hidden_layers=arch.text_layers,
        max_position_embeddings=77, projection_dim=arch.clip_width, hidden_act="gelu",
        bos_token_id=clip_tokenizer.bos_token_id, eos_token_id=clip_tokenizer.eos_token_id,
        pad_token_id=clip_tokenizer.pad_token_id))
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(t5_tokenizer), d_model=arch.t5_width, d_kv=32, d_ff=2 * arch.t5_width,
        num_layers=arch.text_layers, num_heads=arch.t5_width // 32, feed_forward_proj="gated-gelu",
        is_encoder_decoder=False, use_cache=False))
    latent_channels = 16
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * latent_channels, num_layers=arch.double_blocks,
        num_single_layers=arch.single_blocks, attention_head_dim=arch.head_dim, num_attention_heads=arch.heads,
        joint_attention_dim=arch.t5_width, pooled_projection_dim=arch.clip_width, guidance_embeds=False,
        axes_dims_rope=tuple(arch.rope_axes))
    depth = len(arch.vae_channels)
    vae = AutoencoderKL(
        block_out_channels=tuple(arch.vae_channels), down_block_types=("DownEncoderBlock2D",) * depth,
        up_block_types=("UpDecoderBlock2D",) * depth, latent_channels=latent_channels,
        norm_num_groups=arch.norm_groups, layers_per_block=arch.vae_layers, sample_size=scenes.IMAGE_SIZE,
        shift_factor=0.0, use_quant_conv=False, use_post_quant_conv=False, force_upcast=False)
    # Flux.1-dev's scheduler, so sampling shifts the noise levels by the image's token count as it does.
    scheduler = FlowMatchEulerDiscreteScheduler(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096,
                                                max_shift=1.15, shift=3.0, use_dynamic_shifting=True)
    return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tokenizer,
                        text_encoder_2=t5, tokenizer_2=t5_tokenizer, transformer=transformer)


@dataclass
class Dataset:
    """Rendered training scenes on the training device: pixels, each tokenizer's ids of their
    captions, and of the empty caption."""

    pixels: torch.Tensor                 # (N, 3, 64, 64) uint8
    token_ids: dict[str, torch.Tensor]   # per tokenizer, (N, its length) int64
    empty_ids: dict[str, torch.Tensor]   # per tokenizer, (1, its length)

    def batch(self, indices: torch.Tensor) -> torch.Tensor:
        return self.pixels[indices].float() / 127.5 - 1


def training_scenes(size: int, seed: int, two_object_share: float) -> list:
    """`size` training scenes, that share of them with two objects, in an order mixed by seed
    (so that any first few, such as calibration's prompts, hold both kinds)."""
    two = round(size * two_object_share)
    chosen = scenes.sample(size - two, seed) + scenes.sample(two, seed, objects=2)
    return [chosen[i] for i in np.random.default_rng(seed).permutation(size)]


def make_dataset(size: int, seed: int, two_object_share: float, tokenizers: dict, device: torch.device) -> Dataset:
    chosen = training_scenes(size, seed, two_object_share)
    pixels = torch.from_numpy(scenes.render(chosen, seed=seed)).permute(0, 3, 1, 2).contiguous()

    def ids(tokenizer, captions: list[str]) -> torch.Tensor:
        # As the pipelines tokenize: padded to the tokenizer's length, which is what the encoders see.
        return tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                         return_tensors="pt").input_ids.to(device)

    captions = [scene.caption() for scene in chosen]
    return Dataset(pixels.to(device), {name: ids(tok, captions) for name, tok in tokenizers.items()},
                   {name: ids(tok, [""]) for name, tok in tokenizers.items()})


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
    """Every training image's posterior mode, shifted and scaled to zero mean and unit variance;
    sets the VAE's factors to match (a VAE with a shift factor, as Flux.1's, gets the mean; one
    without, as Stable Diffusion's, only the scale)."""
    latents = torch.cat([vae.encode(data.batch(torch.arange(i, min(i + chunk, len(data.pixels)),
                                                            device=data.pixels.device))).latent_dist.mode()
                         for i in range(0, len(data.pixels), chunk)])
    if vae.config.shift_factor is not None:
        vae.register_to_config(shift_factor=float(latents.mean()))
    shifted = latents - (vae.config.shift_factor or 0.0)
    vae.register_to_config(scaling_factor=float(1 / shifted.std()))
    return shifted * vae.config.scaling_factor


def train_denoiser(modules: list[torch.nn.Module], loss_of, samples: int, block, generator: torch.Generator,
                   log: LossLog, phase: str) -> None:
    """Trains `modules` together on `loss_of(indices)` over random batches of the `samples`
    training scenes, with an exponential moving average of their weights copied in at the end."""
    from diffusers.training_utils import EMAModel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    parameters = [p for module in modules for p in module.parameters()]
    device = parameters[0].device
    for module in modules:
        module.train()
    optimizer = torch.optim.AdamW(parameters, lr=block.learning_rate, weight_decay=1e-2)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, block.learning_rate, total_steps=block.steps,
                                                   pct_start=0.05)
    ema = EMAModel(parameters, decay=block.ema_decay, use_ema_warmup=True, foreach=True)
    bar = Progress(range(1, block.steps + 1), phase, "steps")
    for step in bar:
        # Not cuDNN's attention: on an H100 (torch 2.11) its backward fails at the Flux scene
        # model's shapes from batch 64 up and gives NaN below.
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            loss = loss_of(torch.randint(samples, (block.batch_size,), device=device, generator=generator))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        schedule.step()
        ema.step(parameters)
        if _every(step, block.steps):
            log.add(phase, step, loss.item())
            bar.note(loss=f"{log.rows[-1][2]:.4f}")
    ema.copy_to(parameters)
    for module in modules:
        module.eval()


def _kept(block, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Per sample of a batch, whether its caption stays (the rest are dropped for guidance)."""
    return torch.rand(block.batch_size, device=device, generator=generator) >= block.empty_caption_rate


def unet_noise_loss(pipe, latents: torch.Tensor, data: Dataset, block, generator: torch.Generator):
    """SDXL: the UNet predicts the noise added under SDXL's DDPM schedule, conditioned on both
    encoders' penultimate hidden states side by side and the second's projected pooled output."""
    from diffusers import DDPMScheduler

    device = latents.device
    noise_schedule = DDPMScheduler(**SCHEDULE)
    size = scenes.IMAGE_SIZE
    time_ids = torch.tensor([[size, size, 0, 0, size, size]], dtype=torch.float32, device=device)

    def loss_of(indices: torch.Tensor) -> torch.Tensor:
        clean = latents[indices]
        noise = torch.randn(clean.shape, device=device, generator=generator)
        timesteps = torch.randint(noise_schedule.config.num_train_timesteps, (len(indices),), device=device,
                                  generator=generator)
        keep = _kept(block, generator, device).float()
        token_ids = data.token_ids["clip"][indices]
        with _autocast(device):
            first = pipe.text_encoder(token_ids, output_hidden_states=True)
            second = pipe.text_encoder_2(token_ids, output_hidden_states=True)
            context = torch.cat([first.hidden_states[-2], second.hidden_states[-2]], dim=-1)
            prediction = pipe.unet(noise_schedule.add_noise(clean, noise, timesteps), timesteps,
                                   context * keep[:, None, None],
                                   added_cond_kwargs={"text_embeds": second.text_embeds * keep[:, None],
                                                      "time_ids": time_ids.expand(len(indices), -1)}).sample
        return F.mse_loss(prediction.float(), noise)

    return loss_of


def flux_velocity_loss(pipe, latents: torch.Tensor, data: Dataset, block, generator: torch.Generator):
    """Flux: the transformer predicts the velocity (noise minus image) of the straight path from
    the image to noise, at logit-normal noise levels (SD3's default weighting), conditioned on
    CLIP's pooled output and T5's hidden states, with the packed latents and position ids that
    FluxPipeline makes."""
    from diffusers import FluxPipeline

    device = latents.device
    channels, height, width = latents.shape[1:]
    image_ids = FluxPipeline._prepare_latent_image_ids(block.batch_size, height // 2, width // 2, device,
                                                        torch.float32)
    text_ids = torch.zeros(data.token_ids["t5"].shape[1], 3, device=device)

    def packed(tensor: torch.Tensor) -> torch.Tensor:
        return FluxPipeline._pack_latents(tensor, len(tensor), channels, height, width)

    def loss_of(indices: torch.Tensor) -> torch.Tensor:
        clean = latents[indices]
        noise = torch.randn(clean.shape, device=device, generator=generator)
        sigma = torch.sigmoid(torch.randn(len(indices), device=device, generator=generator))
        noisy = clean + sigma[:, None, None, None] * (noise - clean)
        keep = _kept(block, generator, device)[:, None]
        clip_ids = torch.where(keep, data.token_ids["clip"][indices], data.empty_ids["clip"])
        t5_ids = torch.where(keep, data.token_ids["t5"][indices], data.empty_ids["t5"])
        with _autocast(device):
            velocity = pipe.transformer(
                hidden_states=packed(noisy), encoder_hidden_states=pipe.text_encoder_2(t5_ids).last_hidden_state,
                pooled_projections=pipe.text_encoder(clip_ids).pooler_output, timestep=sigma, img_ids=image_ids,
                txt_ids=text_ids, return_dict=False)[0]
        return F.mse_loss(velocity.float(), packed(noise - clean))

    return loss_of


@dataclass(frozen=True)
class SceneModel:
    """What differs between the families' scene models: tokenizers, the untrained pipeline, the
    denoiser's name and its loss."""

    family: str
    backbone: str
    tokenizers: Callable[[], dict]            # {name: tokenizer}
    build: Callable[[object, dict], object]   # (arch, tokenizers) -> pipeline
    loss: Callable[..., Callable]             # (pipe, latents, data, block, generator) -> loss_of(indices)


SCENE_MODELS = {
    "SceneArchitecture": SceneModel(
        "sdxl", "unet", lambda: {"clip": scene_tokenizer()},
        lambda arch, tokenizers: build_sdxl_scenes(arch, tokenizers["clip"]), unet_noise_loss),
    "FluxSceneArchitecture": SceneModel(
        "flux", "transformer", lambda: {"clip": scene_tokenizer(), "t5": scene_t5_tokenizer()},
        lambda arch, tokenizers: build_flux_scenes(arch, tokenizers["clip"], tokenizers["t5"]), flux_velocity_loss),
}


@torch.no_grad()
def held_out_adherence(pipe, prompts: list[str], steps: int, guidance_scale: float, seed: int,
                       call_kwargs: dict) -> dict:
    """The trained pipeline's prompt adherence on held-out scenes, with diffusers' own sampler."""
    from .quality import adherence, adherence_summary

    rows = []
    batch = 16
    for start in range(0, len(prompts), batch):
        chunk = prompts[start:start + batch]
        generator = torch.Generator(pipe.device).manual_seed(seed + start)
        images = pipe(chunk, num_inference_steps=steps, guidance_scale=guidance_scale, output_type="pt",
                      height=scenes.IMAGE_SIZE, width=scenes.IMAGE_SIZE, generator=generator, **call_kwargs).images
        rows += adherence(images.float(), chunk)
    return adherence_summary(rows)["mean"]


def held_out_prompts(count: int) -> list[str]:
    """`count` held-out captions of one object, then `count` of two."""
    return [scene.caption() for objects in (1, 2)
            for scene in scenes.sample(count, scenes.HELD_OUT_SEED, held_out=True, objects=objects)]


def train_scene_model(cfg, device: torch.device) -> tuple[Path, dict]:
    """Trains the scene pipeline of cfg.architecture's family and saves it (fp16, safetensors) to
    cfg.out_dir; returns the folder and the training record, which is also written into it."""
    out = Path(cfg.out_dir).expanduser()
    if out.exists() and not cfg.force:
        raise UserError(f"out_dir={out} exists: choose another folder or set force=true to replace it")
    model = SCENE_MODELS[OmegaConf.get_type(cfg.architecture).__name__]
    started = time.perf_counter()
    torch.manual_seed(cfg.seed)
    generator = torch.Generator(device).manual_seed(cfg.seed)
    tokenizers = model.tokenizers()
    pipe = model.build(cfg.architecture, tokenizers).to(device)
    data = make_dataset(cfg.dataset_size, cfg.seed, cfg.two_object_share, tokenizers, device)
    log = LossLog()
    seconds = {}

    phase_start = time.perf_counter()
    with stage("the VAE's training"):
        train_vae(pipe.vae, data, cfg.vae, generator, log)
        latents = encode_latents(pipe.vae, data)
    seconds["vae"] = time.perf_counter() - phase_start

    phase_start = time.perf_counter()
    with stage(f"the {model.backbone}'s training"):
        train_denoiser([getattr(pipe, model.backbone), pipe.text_encoder, pipe.text_encoder_2],
                       model.loss(pipe, latents, data, cfg.denoiser, generator), len(latents), cfg.denoiser,
                       generator, log, model.backbone)
    seconds[model.backbone] = time.perf_counter() - phase_start

    # What ships is the fp16 pipeline, so that is what gets scored.
    pipe.to(torch.float16).set_progress_bar_config(disable=True)
    prompts = held_out_prompts(cfg.eval_prompts)
    with stage("scoring the held-out prompts"):
        adherence = held_out_adherence(pipe, prompts, cfg.eval_steps, cfg.guidance_scale, cfg.seed,
                                       family_of(model.family).pipeline_call_kwargs(pipe)) if prompts else {}
    record = {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "family": model.family,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "seconds": {key: round(value, 1) for key, value in seconds.items()},
        "final_loss": {"vae": log.final("vae"), model.backbone: log.final(model.backbone)},
        "parameters": {name: sum(p.numel() for p in getattr(pipe, name).parameters())
                       for name in (model.backbone, "vae", "text_encoder", "text_encoder_2")},
        "held_out_adherence": {"prompts": len(prompts), "steps": cfg.eval_steps,
                               "guidance_scale": cfg.guidance_scale, **adherence},
        "held_out_combinations": sorted(map(list, scenes.held_out_combinations())),
        "held_out_colour_orders": sorted(map(list, scenes.held_out_colour_orders())),
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
        calibration = training_scenes(256, seed=1, two_object_share=record["config"]["two_object_share"])
        (staging / CALIBRATION_PROMPTS).write_text("\n".join(scene.caption() for scene in calibration) + "\n")
        (staging / HELD_OUT_PROMPTS).write_text("\n".join(held_out_prompts(64)) + "\n")
