"""Flux.1 (dev, schnell, and the tiny and scene models of its architecture): graphs clip (pooled
embedding), t5 (hidden states), transformer and vae; the DiT's quant levels, which only Linear
layers make up; the data flow of diffusers' FluxPipeline; its architectures and scene loss.

The transformer's graph takes diffusers' own inputs: hidden_states (B, L, 64) packed latents,
encoder_hidden_states (B, T, 4096), pooled_projections (B, 768), timestep (B,) in 0..1, img_ids
(L, 3), txt_ids (T, 3) and, for models with the guidance embedding (dev), guidance (B,); it gives
the velocity `latent` (B, L, 64). L, the image's packed tokens, and T, T5's tokens, are dynamic,
as is the batch.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass

import numpy as np
import torch

from ..quantize.recipe import LayerGroup, LevelTable
from . import components
from .base import SEED, Backbone, HookCaching, ModelFamily, vae_scale_factor
from .encoders import ClipGraph, T5Graph, VaeDecoderGraph, clip_network, t5_network
from ..graphs.networks import BATCH, HEIGHT, TEXT_TOKENS, TOKENS, VAE, WIDTH, Network, Role
from .pipeline import SamplingSettings, TextToImage, padded_ids, say_truncated, t5_dropped_words
from ..runtime.step_modulations import MODULATIONS

# The DiT's levels (every layer is a Linear, so there is no level 1): 2 the feed-forward layers of
# both streams and the single blocks' MLP input projection; 2.5 + the q/k/v projections of both
# streams; 3 + the rest of every block (attention outputs, the single blocks' joint output); 4 = 3
# + FP8 attention, in every block: each is joint attention over the image and text tokens (4608 at
# 1024x1024), long enough for FP8 attention to pay. High precision: the embedders of the image, text,
# timestep and guidance, every AdaLN modulation (norm*.linear: its output scales and shifts every activation of its block, and
# it is a batch-row GEMM with nothing to gain), and the final norm_out/proj_out.
LEVELS = LevelTable(
    levels=(2.0, 2.5, 3.0, 4.0),
    groups=(LayerGroup(2.0, "*.ff.net.*", "nn.Linear"), LayerGroup(2.0, "*.ff_context.net.*", "nn.Linear"),
            LayerGroup(2.0, "*.proj_mlp.", "nn.Linear"),
            LayerGroup(2.5, "*.attn.to_[qkv].", "nn.Linear"), LayerGroup(2.5, "*.attn.add_[qkv]_proj.", "nn.Linear"),
            LayerGroup(3.0, "*", "nn.Linear")),
    high_precision=("x_embedder.*", "context_embedder.*", "time_text_embed.*", "*norm*", "proj_out.*",
                    "pos_embed.*"),
    qkv_level=2.5,
)

# The transformer's packed image tokens: one per 2x2 latent patch.
IMAGE_TOKENS = "L"
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


def transformer_network(guidance: bool) -> Network:
    inputs = {"hidden_states": {0: BATCH, 1: IMAGE_TOKENS}, "encoder_hidden_states": {0: BATCH, 1: TEXT_TOKENS},
              "pooled_projections": {0: BATCH}, "timestep": {0: BATCH}, "img_ids": {0: IMAGE_TOKENS},
              "txt_ids": {0: TEXT_TOKENS}}
    if guidance:
        inputs["guidance"] = {0: BATCH}
    # A transformer without the guidance embedding (Flux.1-schnell's, the scene model's) is exported
    # without that input.
    return Network("transformer", inputs, {"latent": {0: BATCH, 1: IMAGE_TOKENS}}, role=Role.backbone,
                   optional=("guidance",))


def modulations_network(guidance: bool) -> Network:
    """The torch backend's stage of every step's AdaLN modulations (sdquant.runtime.step_modulations):
    each row of the embedding's inputs, all of a generation's steps at once, to its modulations."""
    inputs = {"pooled_projections": {0: BATCH}, "timestep": {0: BATCH}}
    if guidance:
        inputs["guidance"] = {0: BATCH}
    return Network(MODULATIONS, inputs, {MODULATIONS: {0: BATCH}})


CLIP = clip_network("clip", hidden=False, pooled=True)
T5 = t5_network()


def _rotated(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], sequence_dim: int = 2,
             **_) -> torch.Tensor:
    """Flux's rotary embedding of q or k (pairs of neighbouring features rotated by the position's
    angles), with the pairs split by unflatten: diffusers' reshape to x.shape[:-1] records the
    traced sequence length as a constant, which would pin the graph to one image size."""
    cos, sin = _broadcast_tables(cos_sin, sequence_dim, x.device)
    real, imag = x.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(-2)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def _broadcast_tables(cos_sin: tuple[torch.Tensor, torch.Tensor], sequence_dim: int, device) -> list[torch.Tensor]:
    """The rotary tables (tokens, head_dim) shaped to multiply q or k, whose tokens are dimension
    `sequence_dim` (1: batch, tokens, heads; 2: batch, heads, tokens), as diffusers' apply_rotary_emb takes them."""
    index = (None, slice(None), None, slice(None)) if sequence_dim == 1 else (None, None, slice(None), slice(None))
    return [table[index].to(device) for table in cos_sin]


class TransformerGraph(torch.nn.Module):
    # The timestep and guidance Fourier features and the rotary embedding of the position ids
    # build their frequencies with arange on their inputs' device: for a meta trace those inputs
    # stay on the CPU and only the embeddings move to meta (as the UNet's timesteps do).
    host_inputs = ("timestep", "img_ids", "txt_ids", "guidance")

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def host_modules(self) -> list[torch.nn.Module]:
        return [self.transformer.time_text_embed.time_proj, self.transformer.pos_embed]

    @contextlib.contextmanager
    def traceable(self):
        """For the ONNX trace: the rotary embedding and the split of the joint sequence written
        so that the image and text token counts stay dynamic."""
        from diffusers.models.transformers import transformer_flux

        rotary = transformer_flux.apply_rotary_emb
        transformer_flux.apply_rotary_emb = _rotated
        try:
            yield
        finally:
            transformer_flux.apply_rotary_emb = rotary

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
                guidance=None):
        return self.transformer(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                                pooled_projections=pooled_projections, timestep=timestep, img_ids=img_ids,
                                txt_ids=txt_ids, guidance=guidance, return_dict=False)[0]


def model_dtype(transformer) -> torch.dtype:
    """The precision the transformer's forward computes in: its embedded image tokens' (the first
    parameter may be an FP8 layer's)."""
    return transformer.x_embedder.weight.dtype


class ModulationsGraph(torch.nn.Module):
    """Every AdaLN modulation of a transformer whose modulations are precomputed, for rows of its
    embedding's inputs: the pooled text, the timestep in 0..1 and the guidance, scaled by 1000 in
    the model's precision as the transformer's forward scales them."""

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def forward(self, pooled_projections, timestep, guidance=None):
        dtype = model_dtype(self.transformer)
        scaled = [timestep.to(dtype) * 1000] + ([] if guidance is None else [guidance.to(dtype) * 1000])
        return self.transformer.time_text_embed.rows(*scaled, pooled_projections)


class FluxTorchAttnProcessor:
    """diffusers' FluxAttnProcessor over the torch backend's forms of a FluxAttention: a double
    block's joint attention (text tokens first, then the image's; the output split back into the
    image's through to_out and the text's through to_add_out) or a single block's (its output read by
    the block's proj_out), over fused projections and FP8 attention where the layer has its ranges.
    With `rotary_halves`, q's and k's head features come ordered as `use_rotary_halves` leaves them."""

    def __init__(self, rotary_halves: bool = False):
        self.rotary_halves = rotary_halves

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        from ..quantize.shared_ranges import ADDED_QKV, QKV
        from ..runtime.attention import FP8_ATTENTION, attend, no_mask, project

        no_mask(attention_mask)
        query, key, value = (x.unflatten(-1, (-1, attn.head_dim)) for x in project(attn, hidden_states, QKV))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if attn.added_kv_proj_dim is not None:
            text = (x.unflatten(-1, (-1, attn.head_dim)) for x in project(attn, encoder_hidden_states, ADDED_QKV))
            text_query, text_key, text_value = text
            text_query, text_key = attn.norm_added_q(text_query), attn.norm_added_k(text_key)
            query, key, value = (torch.cat(pair, dim=1)
                                 for pair in ((text_query, query), (text_key, key), (text_value, value)))
        if image_rotary_emb is not None:
            rotate = _rotated_halves if self.rotary_halves else apply_rotary_emb
            query = rotate(query, image_rotary_emb, sequence_dim=1)
            key = rotate(key, image_rotary_emb, sequence_dim=1)
        out = attend(attn, query, key, value)
        if encoder_hidden_states is None:
            fp8 = getattr(attn, FP8_ATTENTION, None)
            return out if fp8 is None else fp8.dequantize(out, hidden_states.dtype)
        text_tokens = encoder_hidden_states.shape[1]
        text, image = out.split_with_sizes([text_tokens, out.shape[1] - text_tokens], dim=1)
        image = attn.to_out[1](attn.to_out[0](image.contiguous()))
        return image, attn.to_add_out(text.contiguous())


def _evens_then_odds(features: int) -> torch.Tensor:
    return torch.cat([torch.arange(0, features, 2), torch.arange(1, features, 2)])


def _tables_in_halves_order(pos_embed, args, tables):
    """The rotary embedding's cos and sin tables with each pair's two columns half a head apart."""
    return tuple(torch.cat([table[..., 0::2], table[..., 1::2]], dim=-1) for table in tables)


def _rotated_halves(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], sequence_dim: int = 2) -> torch.Tensor:
    """Flux's rotary embedding of q or k whose head features are ordered evens then odds, with its
    tables ordered alike: pair i is features i and i + head_dim / 2. Each output is the very sum
    diffusers' apply_rotary_emb forms for it."""
    cos, sin = _broadcast_tables(cos_sin, sequence_dim, x.device)
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def use_rotary_halves(transformer) -> bool:
    """Orders every head's q and k features evens then odds in `transformer`, in place: the rows of
    its q and k projections (fused or not), its q/k norms' weights and the rotary tables. Each head's
    q.k, and so the model's output, stays as it was; but the rotary embedding then rotates pairs half
    a head apart, which the compiler fuses with the q/k norms into a kernel reading each half
    contiguously, where diffusers' neighbouring pairs made a two-pass kernel with four masked loads a
    value (Flux.1-dev's q/k norm+RoPE+FP8 cast, 4608 tokens: 0.085 -> 0.067 ms a call on an H200,
    benchmarks/results/flux_kernel_forms_h200.json). All or nothing, as every attention reads the
    one table: False, with nothing changed, where a layer runs another processor (an IP-Adapter's)
    or a projection of a class the reorder does not know (fake quantization), and where the
    transformer is in this order already (reordering twice would pair other features)."""
    from diffusers.models.transformers.transformer_flux import FluxAttention, FluxAttnProcessor

    from ..quantize.shared_ranges import ADDED_QKV, QKV
    from ..runtime.compiled_forms import OUTPUT_ROWS, reorder_outputs

    if _tables_in_halves_order in transformer.pos_embed._forward_hooks.values():
        return False
    layers = [module for module in transformer.modules() if isinstance(module, FluxAttention)]
    projections = {id(attn): [(getattr(attn, name), name == fused) for names, fused in (QKV, ADDED_QKV)
                              for name in (*names[:2], fused) if isinstance(getattr(attn, name, None), torch.nn.Module)]
                   for attn in layers}
    convertible = all(type(attn.processor) in (FluxAttnProcessor, FluxTorchAttnProcessor)
                      and not getattr(attn.processor, "rotary_halves", False)
                      and all(type(layer) in OUTPUT_ROWS for layer, _ in projections[id(attn)]) for attn in layers)
    if not layers or not convertible:
        return False
    for attn in layers:
        head_order = _evens_then_odds(attn.head_dim)
        order = (torch.arange(attn.heads)[:, None] * attn.head_dim + head_order).flatten()
        for layer, fused in projections[id(attn)]:
            # A fused layer's rows are q's, k's and v's: v keeps its order.
            inner = len(order)
            rows = torch.cat([order, order + inner, torch.arange(2 * inner, 3 * inner)]) if fused else order
            reorder_outputs(layer, rows)
        norms = (attn.norm_q, attn.norm_k, getattr(attn, "norm_added_q", None), getattr(attn, "norm_added_k", None))
        for norm in norms:
            if getattr(norm, "weight", None) is not None:
                norm.weight.data = norm.weight.data[head_order.to(norm.weight.device)]
        attn.set_processor(FluxTorchAttnProcessor(rotary_halves=True))
    transformer.pos_embed.register_forward_hook(_tables_in_halves_order)
    return True


class FluxTextToImage(TextToImage):
    """Flux's data flow over stages: clip (input_ids -> pooled), t5 (input_ids -> hidden_states),
    transformer (hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids,
    txt_ids[, guidance] -> latent) and vae (latent -> images). Mirrors diffusers' FluxPipeline, so the
    same prompt, seed and steps give the same image. Guidance is Flux-dev's embedded guidance
    (one transformer call per step); a model without it (schnell) ignores guidance_scale."""

    backbone = "transformer"

    def __init__(self, stages: dict, tokenizers: list, scheduler, backbone_config, vae_scale: int,
                 device: torch.device):
        super().__init__(stages, tokenizers, scheduler, backbone_config, vae_scale, device)
        self.clip_tokenizer, self.t5_tokenizer = tokenizers

    @property
    def guidance_embedded(self) -> bool:
        return bool(getattr(self.backbone_config, "guidance_embeds", False))

    @property
    def text_tokens(self) -> int:
        return text_tokens(self.t5_tokenizer)

    def stage_batches(self, settings: SamplingSettings) -> dict[str, int]:
        """The text encoders see each prompt once, the transformer and the VAE every image."""
        images = len(settings.image_prompts)
        return {"clip": len(settings.prompts), "t5": len(settings.prompts), self.backbone: images, "vae": images}

    def axis_sizes(self, settings: SamplingSettings) -> dict[str, int]:
        return flux_axis_sizes(*self.latent_size(settings), self.text_tokens)

    def latent_size(self, settings: SamplingSettings) -> tuple[int, int]:
        """Latent height and width: the image's over the VAE's scale, floored to whole 2x2 patches."""
        patch = self.vae_scale * 2
        return 2 * (settings.height // patch), 2 * (settings.width // patch)

    def latent_shape(self, settings: SamplingSettings) -> tuple[int, ...]:
        """Unpacked noise (B, C, h, w), as diffusers draws it before packing."""
        return (len(settings.image_prompts), self.backbone_config.in_channels // 4, *self.latent_size(settings))

    def words_lost(self, text: str) -> tuple[str, str]:
        # CLIP's cut only shortens the pooled embedding: T5 still reads those words.
        dropped = t5_dropped_words(self.t5_tokenizer, text, self.text_tokens)
        return (f"T5's {self.text_tokens} tokens", dropped) if dropped else ("", "")

    def encode(self, settings: SamplingSettings, timer) -> tuple[torch.Tensor, torch.Tensor]:
        """T5's hidden states and CLIP's pooled embedding of each prompt, one per image."""
        say_truncated([self.clip_tokenizer], list(settings.prompts), self.told,
                      "Flux's pooled embedding reads only CLIP's window, as diffusers does")
        pooled = timer.time("clip", self.stages["clip"], input_ids=padded_ids(
            self.clip_tokenizer, list(settings.prompts), self.clip_tokenizer.model_max_length, self.device))["pooled"]
        hidden = timer.time("t5", self.stages["t5"], input_ids=padded_ids(
            self.t5_tokenizer, list(settings.prompts), self.text_tokens, self.device))["hidden_states"]
        repeat = settings.images_per_prompt
        return hidden.repeat_interleave(repeat, 0), pooled.repeat_interleave(repeat, 0)

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

    def predict(self, settings: SamplingSettings, step: int, inputs: dict, timer) -> torch.Tensor:
        """The transformer's velocity at this step; under a cache hook, a generation's first step
        starts the hook afresh."""
        stage = self.stages[self.backbone]
        if settings.cache is not None and step == 0:
            stage.reset()
        return timer.time(self.backbone, stage, **inputs)["latent"]

    def __call__(self, settings: SamplingSettings, timer, progress: bool = True,
                 latents: torch.Tensor | None = None) -> torch.Tensor:
        from ..progress import Progress

        # 1. Encode the prompts: T5's hidden states and CLIP's pooled embedding.
        hidden, pooled = self.encode(settings, timer)
        # 2. The packed initial noise, its position ids, and the sigmas shifted for its token count.
        height, width = self.latent_size(settings)
        latents = self.pack(self.initial_latents(settings) if latents is None else latents)
        image_ids = self.image_ids(height, width)
        self.set_timesteps(settings.steps, latents.shape[1])
        guidance = (torch.full([latents.shape[0]], settings.guidance_scale, device=self.device, dtype=torch.float32)
                    if self.guidance_embedded else None)
        self.scheduler.set_begin_index(0)
        # Each row's timestep as backbone_inputs gives it, at every step.
        timesteps = self.scheduler.timesteps[:, None].expand(-1, len(latents)).to(latents.dtype) / 1000
        embedded = {"pooled_projections": pooled, **({} if guidance is None else {"guidance": guidance})}
        modulations = self.step_modulations(timesteps, embedded, timer)
        # 3. Denoise: one transformer call per step (guidance is an embedding, not a second batch).
        for step, t in enumerate(Progress(self.scheduler.timesteps, "denoising", "steps", show=progress, leave=False)):
            conditioning = pooled if modulations is None else modulations[step]
            inputs = self.backbone_inputs(latents, t, hidden, conditioning, image_ids, guidance)
            velocity = self.predict(settings, step, inputs, timer)
            latents = self.scheduler.step(velocity, t, latents, return_dict=False)[0]
        # 4. Unpack and decode.
        return self.decode(self.unpack(latents, height, width), timer)


def flux_axis_sizes(latent_height: int, latent_width: int, t5_tokens: int) -> dict[str, int]:
    """The Flux graphs' axes: the latent's sides (the VAE), its 2x2-packed tokens and T5's tokens."""
    return {HEIGHT: latent_height, WIDTH: latent_width, IMAGE_TOKENS: (latent_height // 2) * (latent_width // 2),
            TEXT_TOKENS: t5_tokens}


@dataclass(frozen=True)
class FluxSizes:
    """A Flux architecture: CLIP and T5 encoders, the transformer's blocks and heads, a 16-channel
    AutoencoderKL."""

    clip_width: int
    clip_layers: int
    clip_heads: int
    t5_width: int
    t5_layers: int
    t5_heads: int
    t5_head_width: int
    t5_ff: int
    double_blocks: int
    single_blocks: int
    heads: int
    head_dim: int
    rope_axes: tuple[int, int, int]
    vae_channels: tuple[int, ...]
    vae_groups: int
    vae_layers: int
    image_size: int
    guidance: bool = True
    clip_activation: str = "quick_gelu"
    # Flux.1's latent scaling and shift (a scene model's are set by its training).
    vae_config: tuple = (("scaling_factor", 0.3611), ("shift_factor", 0.1159))


TINY = FluxSizes(clip_width=32, clip_layers=2, clip_heads=1, t5_width=32, t5_layers=2, t5_heads=4, t5_head_width=8,
                 t5_ff=64, double_blocks=2, single_blocks=2, heads=2, head_dim=16, rope_axes=(4, 6, 6),
                 vae_channels=(8, 8, 16, 16), vae_groups=8, vae_layers=2, image_size=64)

# Flux.1-dev's sizes; its VAE as Flux.1's (16 latent channels).
FULL = FluxSizes(clip_width=768, clip_layers=12, clip_heads=12, t5_width=4096, t5_layers=24, t5_heads=64,
                 t5_head_width=64, t5_ff=10240, double_blocks=19, single_blocks=38, heads=24, head_dim=128,
                 rope_axes=(16, 56, 56), vae_channels=(128, 256, 512, 512), vae_groups=32, vae_layers=2,
                 image_size=1024)


def scene_sizes(arch, image_size: int) -> FluxSizes:
    """The Flux scene model's architecture (config's FluxSceneArchitecture): heads of 32 features in
    both encoders, no guidance embedding, a VAE whose shift and scale training sets."""
    return FluxSizes(
        clip_width=arch.clip_width, clip_layers=arch.text_layers, clip_heads=max(1, arch.clip_width // 32),
        clip_activation="gelu", t5_width=arch.t5_width, t5_layers=arch.text_layers, t5_heads=arch.t5_width // 32,
        t5_head_width=32, t5_ff=2 * arch.t5_width, double_blocks=arch.double_blocks,
        single_blocks=arch.single_blocks, heads=arch.heads, head_dim=arch.head_dim, rope_axes=tuple(arch.rope_axes),
        vae_channels=tuple(arch.vae_channels), vae_groups=arch.norm_groups, vae_layers=arch.vae_layers,
        image_size=image_size, guidance=False, vae_config=(("shift_factor", 0.0), ("force_upcast", False)))


def flux_scheduler():
    """Flux.1-dev's flow-matching scheduler, which shifts the noise levels by the image's token count."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096,
                                           max_shift=1.15, shift=3.0, use_dynamic_shifting=True)


TRANSFORMER = Backbone("transformer", "transformer")
# The transformer's block lists, in the order its forward runs them: double-stream, then single.
BLOCK_STACKS = ("transformer_blocks", "single_transformer_blocks")


class FluxFamily(HookCaching, ModelFamily):
    name = "flux"
    backbones = (TRANSFORMER,)
    hook_block_stacks = BLOCK_STACKS
    tokenizer_folders = ("tokenizer", "tokenizer_2")
    components = ("text_encoder", "text_encoder_2", "transformer", "vae")
    # As diffusers runs Flux.1: its activations overflow fp16.
    gpu_dtype = torch.bfloat16
    default_scheduler = "flow_euler"
    size_reason = "the model's VAE scale factor times its 2x2 latent patches"
    sizes = {"tiny": TINY, "full": FULL}
    level_table = LEVELS
    scene_tokenizers = ("clip", "t5")

    def pipeline_class(self):
        from diffusers import FluxPipeline

        return FluxPipeline

    def backbone_class(self):
        from diffusers import FluxTransformer2DModel

        return FluxTransformer2DModel

    # --- its networks -------------------------------------------------------------------------

    def networks(self, cache=None) -> list[Network]:
        return [CLIP, T5, VAE, transformer_network(guidance=True)]

    def carries_adapters(self, graph: str) -> bool:
        """diffusers' Flux LoRA loader writes into the transformer and CLIP, never into T5."""
        return graph in ("transformer", "clip")

    # --- quantization --------------------------------------------------------------------------

    def scheduler_timestep(self, args: tuple, kwargs: dict):
        # FluxPipeline hands the transformer t / 1000.
        return kwargs["timestep"] * 1000

    def pipeline_call_kwargs(self, pipe) -> dict:
        return {"max_sequence_length": text_tokens(pipe.tokenizer_2)}

    # --- export and engines --------------------------------------------------------------------

    def export_sizes(self, pipe, geometry) -> dict:
        return {"text_tokens": text_tokens(pipe.tokenizer_2)}

    def graph_specs(self, pipe, batch: int, geometry, latent: int, dtype, vae_dtype, cache=None) -> list:
        from ..graphs.specs import GraphSpec
        from ..quantize.quantizers import unsupported_quantizers

        transformer = pipe.transformer.to(dtype)
        config = transformer.config
        tokens, text = (latent // 2) ** 2, text_tokens(pipe.tokenizer_2)
        args = [torch.randn(batch, tokens, config.in_channels, dtype=dtype),
                torch.randn(batch, text, config.joint_attention_dim, dtype=dtype),
                torch.randn(batch, config.pooled_projection_dim, dtype=dtype), torch.full((batch,), 0.5, dtype=dtype),
                torch.zeros(tokens, 3), torch.zeros(text, 3)]
        if config.guidance_embeds:
            args.append(torch.full((batch,), 3.5))
        vae = pipe.vae.to(vae_dtype)
        return [
            GraphSpec(CLIP, ClipGraph(pipe.text_encoder.to(dtype), penultimate=False, hidden=False, pooled=True),
                      (torch.zeros(batch, TOKENS, dtype=torch.int32),)),
            GraphSpec(T5, T5Graph(pipe.text_encoder_2.to(dtype)), (torch.zeros(batch, text, dtype=torch.int32),)),
            GraphSpec(VAE, VaeDecoderGraph(vae), (torch.randn(batch, vae.config.latent_channels, latent, latent,
                                                              dtype=vae_dtype),)),
            GraphSpec(transformer_network(config.guidance_embeds), TransformerGraph(transformer), tuple(args),
                      on_meta=not unsupported_quantizers(transformer)),
        ]

    def profile_axis_sizes(self, graph: str, geometry, record: dict, trt) -> list[dict[str, int]]:
        """T5's tokens as the export recorded them (every Flux graph exported before the length was
        recorded took diffusers' 512)."""
        scale = record.get("vae_scale_factor", 8)
        sizes = flux_axis_sizes(geometry.height // scale, geometry.width // scale,
                                record.get("text_tokens") or T5_TOKENS)
        return [sizes] * 3

    # --- running it ----------------------------------------------------------------------------

    def torch_stages(self, pipe, dtype, cache=None) -> dict:
        from ..runtime.stages import TorchStage

        stages = {"clip": TorchStage(ClipGraph(pipe.text_encoder, penultimate=False, hidden=False, pooled=True),
                                     CLIP, dtype),
                  "t5": TorchStage(T5Graph(pipe.text_encoder_2), T5, dtype),
                  "transformer": self.backbone_stage(pipe.transformer, dtype),
                  "vae": TorchStage(VaeDecoderGraph(pipe.vae), VAE, next(pipe.vae.parameters()).dtype)}
        if cache is not None:
            stages.update(self.cache_stages(self.backbone_modules(pipe), dtype, cache))
        return stages

    def backbone_stage(self, backbone, dtype):
        from ..runtime.stages import TorchStage

        return TorchStage(TransformerGraph(backbone), transformer_network(backbone.config.guidance_embeds), dtype)

    def use_family_forms(self, backbone) -> None:
        from ..runtime.step_modulations import use_step_modulations

        if not use_rotary_halves(backbone):
            print("note: the transformer's q and k stay in diffusers' order (use_rotary_halves): an attention layer "
                  "runs another processor, a projection is fake-quantized, or they are in halves order already")
        use_step_modulations(backbone)

    def generation_stages(self, pipe) -> dict:
        from ..runtime.step_modulations import modulations_stages

        transformer = pipe.transformer
        return modulations_stages(transformer, ModulationsGraph(transformer),
                                  modulations_network(transformer.config.guidance_embeds))

    def fp8_attention_processor(self, attn):
        """The processor for FluxAttention layers diffusers runs with its own FluxAttnProcessor."""
        from diffusers.models.transformers import transformer_flux

        default = type(getattr(attn, "processor", None)) is transformer_flux.FluxAttnProcessor
        return FluxTorchAttnProcessor() if default else None

    def text_to_image(self, stages: dict, parts: dict, scheduler, device):
        return FluxTextToImage(stages, parts["tokenizers"], scheduler, types.SimpleNamespace(**parts["backbone_config"]),
                               vae_scale_factor(parts["vae_config"]), device)

    def native_image_size(self, configs: dict, vae_scale: int) -> int:
        """The VAE's sample size: 1024 for Flux.1, which diffusers' FluxPipeline hard-codes as its
        default (128 latent pixels), and the small size a tiny or scene model was made at."""
        return configs["vae_config"]["sample_size"]

    def size_multiple(self, vae_scale: int, backbone_config: dict | None = None) -> int:
        return vae_scale * (backbone_config or {}).get("patch_size", 2)

    # --- its architectures ---------------------------------------------------------------------

    def build_pipeline(self, sizes: FluxSizes, tokenizers: dict | None = None):
        """CLIP and T5 encoders, a FluxTransformer2DModel and a 16-channel AutoencoderKL, with
        Flux.1-dev's flow-matching scheduler (dynamic shifting)."""
        from diffusers import FluxPipeline, FluxTransformer2DModel

        torch.manual_seed(SEED)
        tokenizers = tokenizers or {}
        clip_tokenizer = tokenizers.get("clip") or components.byte_level_tokenizer()
        t5_tokenizer = tokenizers.get("t5") or components.char_t5_tokenizer()
        clip = components.clip_text_encoder(clip_tokenizer, sizes.clip_width, sizes.clip_layers, sizes.clip_heads,
                                            activation=sizes.clip_activation)
        t5 = components.t5_text_encoder(t5_tokenizer, sizes.t5_width, sizes.t5_layers, sizes.t5_heads,
                                        sizes.t5_head_width, sizes.t5_ff)
        latent_channels = 16
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=4 * latent_channels, num_layers=sizes.double_blocks,
            num_single_layers=sizes.single_blocks, attention_head_dim=sizes.head_dim, num_attention_heads=sizes.heads,
            joint_attention_dim=sizes.t5_width, pooled_projection_dim=sizes.clip_width,
            guidance_embeds=sizes.guidance, axes_dims_rope=sizes.rope_axes)
        vae = components.autoencoder(sizes.vae_channels, sizes.vae_groups, sizes.vae_layers, latent_channels,
                                     sizes.image_size, use_quant_conv=False, use_post_quant_conv=False,
                                     **dict(sizes.vae_config))
        return FluxPipeline(scheduler=flux_scheduler(), vae=vae, text_encoder=clip, tokenizer=clip_tokenizer,
                            text_encoder_2=t5, tokenizer_2=t5_tokenizer, transformer=transformer)

    # --- the scene model -----------------------------------------------------------------------

    def scene_sizes(self, arch, image_size: int) -> FluxSizes:
        return scene_sizes(arch, image_size)

    def scene_loss(self, pipe, latents: torch.Tensor, data, block, generator: torch.Generator):
        """The transformer predicts the velocity (noise minus image) of the straight path from the
        image to noise, at logit-normal noise levels (SD3's default weighting), conditioned on CLIP's
        pooled output and T5's hidden states, with the packed latents and position ids that
        FluxPipeline makes; a dropped caption is the empty one, what diffusers' true CFG feeds."""
        import torch.nn.functional as F
        from diffusers import FluxPipeline

        from .training import autocast, kept

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
            keep = kept(block, generator, device)[:, None]
            clip_ids = torch.where(keep, data.token_ids["clip"][indices], data.empty_ids["clip"])
            t5_ids = torch.where(keep, data.token_ids["t5"][indices], data.empty_ids["t5"])
            with autocast(device):
                velocity = pipe.transformer(
                    hidden_states=packed(noisy), encoder_hidden_states=pipe.text_encoder_2(t5_ids).last_hidden_state,
                    pooled_projections=pipe.text_encoder(clip_ids).pooler_output, timestep=sigma, img_ids=image_ids,
                    txt_ids=text_ids, return_dict=False)[0]
            return F.mse_loss(velocity.float(), packed(noise - clean))

        return loss_of


FLUX = FluxFamily()
