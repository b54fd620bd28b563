"""Training stage: a built-in scene model, a pipeline of any family with a scene architecture
(SDXL's, Flux's and Wan2.2's), trained from scratch with diffusers' and transformers' own classes:
an image family on captioned scenes of one and two objects (``sdquant.quality.scenes``), a video
family on captioned clips of moving shapes (``sdquant.quality.clips``).

Two phases, as latent diffusion is trained: first the autoencoder (AutoencoderKL, or the Wan VAE
with its frame axis) on the pixels alone, until its reconstructions keep every attribute; then the
denoisers and their text encoders on the autoencoder's clean latents (the posterior mode, so the
target carries no posterior noise), on the family's own loss (ModelFamily.scene_loss: the SDXL
UNet's noise prediction, the Flux transformer's and each Wan expert's flow-matching velocity), in
the family's phases (ModelFamily.scene_phases: all together, or one Wan expert first), with a share
of the captions dropped so that guidance works at sampling time. Each result is saved
with ``save_pretrained`` in fp16 and loads like any folder of its family.
"""

from __future__ import annotations

import dataclasses
import json
import math
import string
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from . import clips, scenes
from .scoring import adherence, adherence_summary, video_adherence
from ..artifacts import atomic_folder
from ..cli import stage
from ..errors import UserError
from ..families import scene_family
from ..families.training import autocast
from ..progress import Progress
from ..report import library_versions

TRAINING_RECORD = "training.json"
LOSS_LOG = "loss_log.csv"
CALIBRATION_PROMPTS = "calib_prompts.txt"
HELD_OUT_PROMPTS = "heldout_prompts.txt"
# The Flux scene model's T5 sequence: its longest caption is 17 pieces with the end token. The
# pipelines take the length from the saved tokenizer; diffusers' 512 would make nine tenths of
# every training step and every sampling step padding.
SCENE_TEXT_TOKENS = 32


def scene_tokenizer(vocabulary: list[str]):
    """A CLIP tokenizer whose merges spell every caption word (`vocabulary`) as one token; any other
    word still encodes, letter by letter."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import CLIPTokenizer

    alphabet = list(string.ascii_lowercase + string.digits + ",.!?'-")
    bpe = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=1000, initial_alphabet=alphabet, end_of_word_suffix="</w>",
                                  show_progress=False)
    bpe.train_from_iterator([" ".join(vocabulary)] * 4, trainer)
    learned = json.loads(bpe.to_str())["model"]
    vocab = dict(learned["vocab"])
    for piece in alphabet + [letter + "</w>" for letter in alphabet]:
        vocab.setdefault(piece, len(vocab))
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[tuple(pair) for pair in learned["merges"]], model_max_length=77)


def scene_t5_tokenizer(vocabulary: list[str]):
    """A T5 tokenizer (SentencePiece-style unigram) with every caption word (`vocabulary`) as one
    piece; any other word still encodes, letter by letter. It saves and loads as T5's own (and as
    UMT5's, which is T5's tokenizer with another vocabulary)."""
    from transformers import T5TokenizerFast

    letters = list(string.ascii_letters + string.digits + string.punctuation)
    words = [("\u2581" + word, 0.0) for word in vocabulary if word.isalnum()]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -5.0), *words,
             *[(letter, -10.0) for letter in letters]]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=SCENE_TEXT_TOKENS)


@dataclass(frozen=True)
class SceneKind:
    """What a family's scene model learns from and is scored on: still scenes for an image family,
    clips of moving shapes for a video family (ModelFamily.output says which)."""

    module: types.ModuleType          # sdquant.quality.scenes or .clips: sample, render, caption_vocabulary
    # Axis orders: from the renders (N, [frames,] 64, 64, 3) to the autoencoder's input
    # (N, 3, [frames,] 64, 64), and from that to the pipelines' samples (N, [frames,] 3, 64, 64).
    to_autoencoder: tuple[int, ...]
    to_samples: tuple[int, ...]
    # Per sample, what the detector reads back against its prompt (scoring.adherence or video_adherence).
    score: Callable[[torch.Tensor, list[str]], list[dict]]
    # What the family's diffusers pipeline is asked for besides the prompts, and where its result
    # holds the samples.
    call_kwargs: dict
    result: str
    # What training never sees, by the training record's name for it.
    held_out: dict[str, Callable[[], set]]

    @property
    def attributes(self) -> tuple[str, ...]:
        """What the detector reads: the scenes' place and size, or the clips' motion."""
        return self.module.ATTRIBUTES

    def pixels(self, rendered: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(rendered).permute(*self.to_autoencoder).contiguous()

    def held_out_record(self) -> dict:
        return {name: sorted(map(list, combinations())) for name, combinations in self.held_out.items()}


SCENE_KINDS = {
    "image": SceneKind(scenes, (0, 3, 1, 2), (0, 1, 2, 3), adherence, {}, "images",
                       {"held_out_combinations": scenes.held_out_combinations,
                        "held_out_colour_orders": scenes.held_out_colour_orders}),
    "video": SceneKind(clips, (0, 4, 1, 2, 3), (0, 2, 1, 3, 4), video_adherence, {"num_frames": clips.FRAMES}, "frames",
                       {"held_out_combinations": clips.held_out_combinations, "held_out_pairs": clips.held_out_pairs}),
}


def signed(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 pixels as the autoencoder takes them, in [-1, 1]."""
    return pixels.float() / 127.5 - 1


@dataclass
class Dataset:
    """Rendered training scenes on the training device: pixels, each tokenizer's ids of their
    captions, and of the empty caption."""

    pixels: torch.Tensor                 # (N, 3, 64, 64) or (N, 3, frames, 64, 64) uint8
    token_ids: dict[str, torch.Tensor]   # per tokenizer, (N, its length) int64
    empty_ids: dict[str, torch.Tensor]   # per tokenizer, (1, its length)

    def batch(self, indices: torch.Tensor) -> torch.Tensor:
        return signed(self.pixels[indices])


def training_scenes(kind: SceneKind, size: int, seed: int, two_object_share: float) -> list:
    """`size` training scenes (or clips), that share of them with two objects, in an order mixed by
    seed (so that any first few, such as calibration's prompts, hold both kinds)."""
    two = round(size * two_object_share)
    chosen = kind.module.sample(size - two, seed) + kind.module.sample(two, seed, objects=2)
    return [chosen[i] for i in np.random.default_rng(seed).permutation(size)]


def make_dataset(kind: SceneKind, size: int, seed: int, two_object_share: float, tokenizers: dict,
                 device: torch.device) -> Dataset:
    chosen = training_scenes(kind, size, seed, two_object_share)
    pixels = kind.pixels(kind.module.render(chosen, seed=seed))

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

    def final(self, phase: str, last_steps: int = 100) -> float:
        """The mean loss the phase logged over its last `last_steps` steps."""
        rows = [(step, loss) for name, step, loss in self.rows if name == phase]
        if not rows:
            return math.nan
        end = rows[-1][0]
        return float(np.mean([loss for step, loss in rows if step > end - last_steps]))

    def write(self, path: Path) -> None:
        path.write_text("phase,step,loss\n" + "".join(f"{p},{s},{v:.6f}\n" for p, s, v in self.rows))


def _every(step: int, total: int) -> bool:
    """Whether to read the loss back this step: often enough for a curve, rarely enough that the
    GPU never waits on the host."""
    return step % 25 == 0 or step == total


def kl_divergence(posterior) -> torch.Tensor:
    """The posterior's KL divergence from the unit normal, summed over every latent element and
    averaged over the batch. diffusers' DiagonalGaussianDistribution.kl() sums axes 1-3 only, which
    for the Wan VAE's (N, C, frames, h, w) latents leaves the width out, and a mean over it would
    weigh the term 16x less than for an image VAE."""
    terms = posterior.mean.float() ** 2 + posterior.var.float() - 1.0 - posterior.logvar.float()
    return 0.5 * terms.flatten(1).sum(1).mean()


def one_cycle(optimizer, learning_rate: float, steps: int):
    """A one-cycle schedule warming up over 5% of the steps, or a step and a half where that is less:
    torch's OneCycleLR divides by zero where its warm-up ends exactly on its first step (20 steps at
    5%)."""
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, learning_rate, total_steps=steps,
                                               pct_start=min(0.9, max(0.05, 1.5 / steps)))


class VaeLoss(torch.nn.Module):
    """The VAE's training loss on a batch of pixels (reconstruction plus the weighted KL term), the
    posterior sampled with the `noise` given, so that a CUDA graph can replay the whole step."""

    def __init__(self, vae, kl_weight: float):
        super().__init__()
        self.vae = vae
        self.kl_weight = kl_weight

    def posterior(self, pixels: torch.Tensor):
        with autocast(pixels.device):
            return self.vae.encode(pixels).latent_dist

    def forward(self, pixels: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        posterior = self.posterior(pixels)
        with autocast(pixels.device):
            reconstruction = self.vae.decode(posterior.mean + posterior.std * noise).sample
        return F.mse_loss(reconstruction.float(), pixels) + self.kl_weight * kl_divergence(posterior)


def train_vae(vae, data: Dataset, block, generator: torch.Generator, log: LossLog) -> None:
    device = data.pixels.device
    vae.train()
    # One fused kernel for the whole update on a GPU, where these small models wait on launches.
    optimizer = torch.optim.AdamW(vae.parameters(), lr=block.learning_rate, weight_decay=0.0,
                                  fused=device.type == "cuda")
    schedule = one_cycle(optimizer, block.learning_rate, block.steps)
    loss_of = VaeLoss(vae, block.kl_weight)
    # The posterior's shape and dtype, which the noise drawn for each step takes.
    with torch.no_grad():
        latent = loss_of.posterior(data.batch(torch.arange(block.batch_size, device=device) % len(data.pixels))).mean

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        pixels = data.batch(torch.randint(len(data.pixels), (block.batch_size,), device=device, generator=generator))
        return pixels, torch.randn(latent.shape, dtype=latent.dtype, device=device, generator=generator)

    if block.cuda_graph:
        # The capture's sample batch is one more draw: a graphed run sees other batches than an eager one.
        loss_of = torch.cuda.make_graphed_callables(loss_of, batch())
    bar = Progress(range(1, block.steps + 1), "vae", "steps")
    for step in bar:
        loss = loss_of(*batch())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if _every(step, block.steps):
            log.add("vae", step, loss.item())
            bar.note(loss=f"{log.rows[-1][2]:.4f}")
    vae.eval()


@torch.no_grad()
def encode_latents(vae, data: Dataset, chunk: int = 256) -> torch.Tensor:
    """Every training sample's posterior mode, brought to zero mean and unit variance; sets the VAE's
    statistics to match: the Wan VAE's per channel (latents_mean, latents_std, which WanPipeline
    decodes with), else a VAE with a shift factor (Flux.1's) gets the mean and a scale, one without
    (Stable Diffusion's) only the scale."""
    latents = torch.cat([vae.encode(data.batch(torch.arange(i, min(i + chunk, len(data.pixels)),
                                                            device=data.pixels.device))).latent_dist.mode()
                         for i in range(0, len(data.pixels), chunk)])
    if "latents_mean" in vae.config:
        per_channel = [0, *range(2, latents.dim())]
        mean, std = latents.mean(per_channel), latents.std(per_channel)
        vae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())
        shape = (1, -1, *[1] * (latents.dim() - 2))
        return (latents - mean.view(shape)) / std.view(shape)
    if vae.config.shift_factor is not None:
        vae.register_to_config(shift_factor=float(latents.mean()))
    shifted = latents - (vae.config.shift_factor or 0.0)
    vae.register_to_config(scaling_factor=float(1 / shifted.std()))
    return shifted * vae.config.scaling_factor


def train_denoiser(modules: list[torch.nn.Module], loss_of, samples: int, steps: int, block,
                   generator: torch.Generator, log: LossLog, phase: str) -> None:
    """Trains `modules` together on `loss_of(indices)` for `steps` random batches of the `samples`
    training scenes, with an exponential moving average of their weights copied in at the end."""
    from diffusers.training_utils import EMAModel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    parameters = [p for module in modules for p in module.parameters()]
    device = parameters[0].device
    for module in modules:
        module.train()
    optimizer = torch.optim.AdamW(parameters, lr=block.learning_rate, weight_decay=1e-2, fused=device.type == "cuda")
    schedule = one_cycle(optimizer, block.learning_rate, steps)
    ema = EMAModel(parameters, decay=block.ema_decay, use_ema_warmup=True, foreach=True)
    # Only the training step is compiled: the evaluation after it samples other batch sizes eagerly.
    loss_of = torch.compile(loss_of) if block.compile else loss_of
    bar = Progress(range(1, steps + 1), phase, "steps")
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
        if _every(step, steps):
            log.add(phase, step, loss.item())
            bar.note(loss=f"{log.rows[-1][2]:.4f}")
    ema.copy_to(parameters)
    for module in modules:
        module.eval()


@torch.no_grad()
def held_out_adherence(pipe, kind: SceneKind, prompts: list[str], steps: int, guidance_scale: float, seed: int,
                       call_kwargs: dict) -> dict:
    """The trained pipeline's prompt adherence on held-out prompts, with diffusers' own sampler."""
    rows = []
    batch = 16
    for start in range(0, len(prompts), batch):
        chunk = prompts[start:start + batch]
        generator = torch.Generator(pipe.device).manual_seed(seed + start)
        result = pipe(chunk, num_inference_steps=steps, guidance_scale=guidance_scale, output_type="pt",
                      height=scenes.IMAGE_SIZE, width=scenes.IMAGE_SIZE, generator=generator, **kind.call_kwargs,
                      **call_kwargs)
        rows += kind.score(getattr(result, kind.result).float(), chunk)
    return adherence_summary(rows)["mean"]


@torch.no_grad()
def reconstruction_adherence(vae, kind: SceneKind, held_out: list) -> dict:
    """The detector's reading of the VAE's reconstructions of held-out scenes' renders: about the
    most a denoiser on its latents can score."""
    device = next(vae.parameters()).device
    rows = []
    for start in range(0, len(held_out), 64):
        chunk = held_out[start:start + 64]
        rendered = kind.pixels(kind.module.render(chunk)).to(device)
        with autocast(device):
            decoded = vae.decode(vae.encode(signed(rendered)).latent_dist.mode()).sample
        rows += kind.score((decoded.float() / 2 + 0.5).clamp(0, 1).permute(*kind.to_samples),
                           [scene.caption() for scene in chunk])
    return adherence_summary(rows)["mean"] if rows else {}


def keep_trained_vae(pipe, earlier: Path, log: LossLog) -> float:
    """Loads the VAE of an earlier scene model folder into `pipe`'s, which must have its sizes, and
    its loss rows into `log`; returns the seconds its training took there."""
    trained = type(pipe.vae).from_pretrained(earlier / "vae")
    # What training measures or sets on a VAE of given sizes (encode_latents sets them again).
    measured = {"latents_mean", "latents_std", "shift_factor", "scaling_factor"}
    differing = [f"{key} {value} against this run's {pipe.vae.config.get(key)}" for key, value in trained.config.items()
                 if not key.startswith("_") and key not in measured and pipe.vae.config.get(key) != value]
    if differing:
        raise UserError(f"vae_from={earlier}: its VAE has other sizes ({'; '.join(differing)}): give this run the "
                        "architecture's VAE sizes that folder was trained with")
    pipe.vae.load_state_dict(trained.state_dict())
    for line in (earlier / LOSS_LOG).read_text().splitlines()[1:]:
        phase, step, loss = line.split(",")
        if phase == "vae":
            log.add(phase, int(step), float(loss))
    return json.loads((earlier / TRAINING_RECORD).read_text())["seconds"]["vae"]


def held_out_scenes(kind: SceneKind, count: int) -> list:
    """`count` held-out scenes (or clips) of one object, then `count` of two."""
    return [scene for objects in (1, 2)
            for scene in kind.module.sample(count, kind.module.HELD_OUT_SEED, held_out=True, objects=objects)]


SCENE_TOKENIZERS = {"clip": scene_tokenizer, "t5": scene_t5_tokenizer}


def train_scene_model(app, device: torch.device) -> tuple[Path, dict]:
    """Trains the scene pipeline of app.family at app.architecture's sizes and saves it (fp16,
    safetensors) to app.out_dir; returns the folder and the training record, which is also
    written into it. `app`: the settled training settings (its family's config.SceneTrainingApp)."""
    family = scene_family(app)
    out = Path(app.out_dir).expanduser()
    if out.exists() and not app.force:
        raise UserError(f"out_dir={out} exists: choose another folder or set force=true to replace it")
    if app.vae.cuda_graph and app.vae_from is None and device.type != "cuda":
        raise UserError(f"vae.cuda_graph=true replays CUDA graphs, and this run trains on {device}: "
                        "set vae.cuda_graph=false, or device=cuda on a machine with a GPU")
    kind = SCENE_KINDS[family.output]
    started = time.perf_counter()
    torch.manual_seed(app.seed)
    generator = torch.Generator(device).manual_seed(app.seed)
    vocabulary = kind.module.caption_vocabulary()
    tokenizers = {name: SCENE_TOKENIZERS[name](vocabulary) for name in app.tokenizers}
    pipe = family.build_pipeline(app.architecture.sizes(scenes.IMAGE_SIZE), tokenizers).to(device)
    data = make_dataset(kind, app.dataset_size, app.seed, app.two_object_share, tokenizers, device)
    log = LossLog()
    seconds = {}

    phase_start = time.perf_counter()
    if app.vae_from is None:
        # The VAE's convolutions keep one shape all training: let cuDNN time its algorithms once.
        with stage("the VAE's training"), torch.backends.cudnn.flags(enabled=True, benchmark=True):
            train_vae(pipe.vae, data, app.vae, generator, log)
        seconds["vae"] = time.perf_counter() - phase_start
    else:
        seconds["vae"] = keep_trained_vae(pipe, Path(app.vae_from).expanduser(), log)
    with stage("encoding the training samples"):
        latents = encode_latents(pipe.vae, data)
    held_out = held_out_scenes(kind, app.eval_prompts)
    prompts = [scene.caption() for scene in held_out]
    with stage("scoring the VAE's reconstructions of held-out scenes"):
        reconstructed = reconstruction_adherence(pipe.vae, kind, held_out)

    phases = family.scene_phases(pipe, latents, data, app.denoiser, generator)
    for phase in phases:
        phase_start = time.perf_counter()
        with stage(f"the {phase.name}'s training"):
            train_denoiser(phase.modules, phase.loss_of, len(latents), phase.steps, app.denoiser, generator, log,
                           phase.name)
            phase.then()
        seconds[phase.name] = time.perf_counter() - phase_start

    # What ships is the fp16 pipeline, so that is what gets scored, its VAE decoding as the
    # family's runtime decodes it (the Wan VAE in fp32).
    pipe.to(torch.float16).set_progress_bar_config(disable=True)
    pipe.vae.to(family.decoder_dtype(pipe.vae.config, torch.float16))
    with stage("scoring the held-out prompts"):
        adherence = held_out_adherence(pipe, kind, prompts, app.eval_steps, app.guidance_scale, app.seed,
                                       family.pipeline_call_kwargs(pipe)) if prompts else {}
    # Its weights were fp16 before the upcast, so they are stored in fp16 without loss.
    pipe.vae.to(torch.float16)
    record = {
        "config": json.loads(json.dumps(dataclasses.asdict(app), default=str)),
        "family": app.family,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "seconds": {key: round(value, 1) for key, value in seconds.items()},
        "final_loss": {"vae": log.final("vae"), **{phase.name: log.final(phase.name) for phase in phases}},
        "parameters": {name: sum(p.numel() for p in getattr(pipe, name).parameters()) for name in family.components},
        "held_out_adherence": {"prompts": len(prompts), "steps": app.eval_steps,
                               "guidance_scale": app.guidance_scale, **adherence},
        "reconstruction_adherence": reconstructed,
        "attributes": list(kind.attributes),
        **kind.held_out_record(),
        "vae_from": app.vae_from,
        "versions": library_versions(),
    }
    with stage(f"saving the model to {out}"):
        save(pipe, kind, out, record, log)
    record["seconds"]["total"] = round(time.perf_counter() - started, 1)
    return out, record


def save(pipe, kind: SceneKind, out: Path, record: dict, log: LossLog) -> None:
    """Writes the whole folder under a temporary name and renames it when complete."""
    with atomic_folder(out) as staging:
        pipe.save_pretrained(staging, safe_serialization=True)
        (staging / TRAINING_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        log.write(staging / LOSS_LOG)
        calibration = training_scenes(kind, 256, seed=1, two_object_share=record["config"]["two_object_share"])
        (staging / CALIBRATION_PROMPTS).write_text("\n".join(scene.caption() for scene in calibration) + "\n")
        (staging / HELD_OUT_PROMPTS).write_text("\n".join(scene.caption() for scene in held_out_scenes(kind, 64)) + "\n")
