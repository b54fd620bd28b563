"""Stable Diffusion 3.5 (large, large turbo, medium, and the tiny model of its architecture): graphs
clip_l and clip_g (penultimate hidden states and pooled projection), t5 (hidden states),
transformer and vae; the MMDiT's quant levels, which only Linear layers make up; the data flow of
diffusers' StableDiffusion3Pipeline, classifier-free guidance over a doubled batch included; its
architectures.

The transformer's graph takes diffusers' own inputs: hidden_states (B, 16, h, w) latents,
encoder_hidden_states (B, 77 + T, 4096) (both CLIP encoders' hidden states side by side, padded to
T5's width, then T5's), pooled_projections (B, 2048) (both CLIP projections) and timestep (B,) on
the scheduler's 0..1000 scale, in fp32 as the pipeline hands it; it gives the velocity `latent`
(B, 16, h, w). The batch, the latent's sides, T5's tokens and so the joint text axis are dynamic.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..quantize.recipe import LayerGroup, LevelTable
from . import components
from .base import SEED, Backbone, ModelFamily, vae_scale_factor
from .encoders import ClipGraph, T5Graph, VaeDecoderGraph, clip_network, t5_network
from .flux import calculate_shift
from ..graphs.networks import BATCH, HEIGHT, LATENT, TEXT_TOKENS, TOKENS, VAE, WIDTH, Network, Role
from .pipeline import SamplingSettings, TextToImage, padded_ids, say_truncated, shortened, t5_dropped_words
from ..runtime.step_modulations import MODULATIONS

# The MMDiT's levels (every layer of its blocks is a Linear, so there is no level 1): 2 the
# feed-forward layers of both streams; 2.5 + the q/k/v projections of the joint attention (image
# and text) and of SD3.5-medium's second, image-only attention (attn2); 3 + the rest of every block
# (the attention outputs to_out and to_add_out); 4 = 3 + FP8 attention in every block: each joint
# attention runs over the image's and the text's tokens (4096 + 333 at 1024x1024), long enough for
# FP8 attention to pay. High precision, as in Flux's recipe: the patch, text and timestep embedders,
# every AdaLN modulation (norm1.linear, norm1_context.linear: its output scales and shifts every
# activation of its block, and it is a batch-row GEMM with nothing to gain) and norm_out/proj_out
# (its output is the velocity itself). ModelOpt's diffusers example keeps the embedders and norm_out
# in high precision too, but quantizes proj_out and the AdaLN modulations.
LEVELS = LevelTable(
    levels=(2.0, 2.5, 3.0, 4.0),
    groups=(LayerGroup(2.0, "*.ff.net.*", "nn.Linear"), LayerGroup(2.0, "*.ff_context.net.*", "nn.Linear"),
            LayerGroup(2.5, "*.attn.to_[qkv].", "nn.Linear"), LayerGroup(2.5, "*.attn2.to_[qkv].", "nn.Linear"),
            LayerGroup(2.5, "*.attn.add_[qkv]_proj.", "nn.Linear"),
            LayerGroup(3.0, "*", "nn.Linear")),
    high_precision=("pos_embed.*", "context_embedder.*", "time_text_embed.*", "*norm*", "proj_out.*"),
    qkv_level=2.5,
)

# T5's sequence in diffusers' StableDiffusion3Pipeline (its max_sequence_length default).
T5_TOKENS = 256
# The transformer's text axis: CLIP's window, then T5's tokens.
JOINT_TOKENS = "J"

CLIP_L = dataclasses.replace(clip_network("clip_l", pooled=True), guided=True)
CLIP_G = dataclasses.replace(clip_network("clip_g", pooled=True), guided=True)
T5 = dataclasses.replace(t5_network(), guided=True)
TRANSFORMER = Network(
    "transformer", {"hidden_states": LATENT, "encoder_hidden_states": {0: BATCH, 1: JOINT_TOKENS},
                    "pooled_projections": {0: BATCH}, "timestep": {0: BATCH}},
    {"latent": LATENT}, role=Role.backbone, guided=True, kept_precision=("timestep",))
NETWORKS = (CLIP_L, CLIP_G, T5, VAE, TRANSFORMER)
# The torch backend's stage of every step's AdaLN modulations (sdquant.runtime.step_modulations):
# each row of the embedding's inputs, all of a generation's steps at once, to its modulations.
MODULATIONS_NETWORK = Network(MODULATIONS, {"pooled_projections": {0: BATCH}, "timestep": {0: BATCH}},
                              {MODULATIONS: {0: BATCH}}, kept_precision=("timestep",))


def text_tokens(t5_tokenizer) -> int:
    """T5's sequence length: its tokenizer's own length up to diffusers' 256."""
    return min(T5_TOKENS, int(t5_tokenizer.model_max_length))


def sd3_axis_sizes(latent_height: int, latent_width: int, t5_tokens: int) -> dict[str, int]:
    """The SD3 graphs' axes: the latent's sides, T5's tokens and the joint text axis."""
    return {HEIGHT: latent_height, WIDTH: latent_width, TEXT_TOKENS: t5_tokens, JOINT_TOKENS: TOKENS + t5_tokens}


class TransformerGraph(torch.nn.Module):
    """SD3Transformer2DModel with diffusers' inputs, the timestep in fp32 as the pipeline hands it
    over (TRANSFORMER.kept_precision).

    It traces with the latent's sides dynamic as it is: the crop of PatchEmbed's position grid and
    the unpatchifying reshape compute from the input's shape, which the tracer records as shape
    ops (the graph equals torch at latent sizes other than the traced one)."""

    # The timestep's Fourier features build their frequencies with arange on the timestep's device:
    # for a meta trace it stays on the CPU and only its embedding moves to meta.
    host_inputs = ("timestep",)

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def host_modules(self) -> list[torch.nn.Module]:
        return [self.transformer.time_text_embed.time_proj]

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep):
        return self.transformer(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                                pooled_projections=pooled_projections, timestep=timestep, return_dict=False)[0]


class ModulationsGraph(torch.nn.Module):
    """Every AdaLN modulation of a transformer whose modulations are precomputed, for rows of its
    embedding's inputs: the pooled text and the timestep, as the transformer's forward hands them on."""

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def forward(self, pooled_projections, timestep):
        return self.transformer.time_text_embed.rows(timestep, pooled_projections)


class SD3TorchAttnProcessor:
    """diffusers' JointAttnProcessor2_0 on an attention layer as the torch backend runs it (converted
    to FP8, or 16-bit with fused projections when compiled): a joint attention (the image's tokens
    first, then the text's; the output split back into the image's through to_out and the text's
    through to_add_out, which the last block has none of) or SD3.5-medium's image-only attn2, over
    fused projections and FP8 attention where the layer has its ranges."""

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, *args, **kwargs):
        from ..quantize.shared_ranges import ADDED_QKV, QKV
        from ..runtime.attention import attend, no_mask, project

        no_mask(attention_mask)
        query, key, value = _per_head(attn, project(attn, hidden_states, QKV), attn.norm_q, attn.norm_k)
        if encoder_hidden_states is not None:
            text = _per_head(attn, project(attn, encoder_hidden_states, ADDED_QKV), attn.norm_added_q,
                             attn.norm_added_k)
            query, key, value = (torch.cat(pair, dim=1) for pair in zip((query, key, value), text))
        out = attend(attn, query, key, value)
        image_tokens = hidden_states.shape[1]
        image = attn.to_out[1](attn.to_out[0](out[:, :image_tokens].contiguous()))
        if encoder_hidden_states is None:
            return image
        text = out[:, image_tokens:]
        # The last block's text stream ends here: its block reads no text output.
        return image, text if attn.to_add_out is None else attn.to_add_out(text.contiguous())


def _per_head(attn, projections, norm_q, norm_k) -> tuple[torch.Tensor, ...]:
    """q, k and v as (batch, tokens, heads, head_dim), q and k normed where the layer norms them."""
    query, key, value = (x.unflatten(-1, (attn.heads, -1)) for x in projections)
    return (query if norm_q is None else norm_q(query)), (key if norm_k is None else norm_k(key)), value


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
        return text_tokens(self.t5_tokenizer)

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
        from ..progress import Progress

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


@dataclass(frozen=True)
class SD3Sizes:
    """An SD3 architecture: CLIP-L and CLIP-G encoders (both with projections), a T5 encoder, the
    MMDiT's blocks and heads, a 16-channel AutoencoderKL."""

    clip_widths: tuple[int, int]
    clip_layers: tuple[int, int]
    clip_heads: tuple[int, int]
    t5_width: int
    t5_layers: int
    t5_heads: int
    t5_head_width: int
    t5_ff: int
    layers: int
    heads: int
    head_dim: int
    # The side of the position grid (in patches) that images are cropped from.
    pos_embed_max_size: int
    # Blocks with SD3.5-medium's second, image-only attention.
    dual_attention_layers: tuple[int, ...]
    vae_channels: tuple[int, ...]
    vae_groups: int
    vae_layers: int
    image_size: int


# Three blocks: one with SD3.5-medium's dual attention, one plain, and the last, whose text stream
# ends at its attention; RMS-normed q and k, as in both SD3.5 models. CLIP-G wider than CLIP-L and
# both narrower than T5 together, so the order of the encoders and the padding show in the states.
TINY = SD3Sizes(clip_widths=(32, 48), clip_layers=(2, 2), clip_heads=(2, 3), t5_width=96, t5_layers=2, t5_heads=4,
                t5_head_width=16, t5_ff=128, layers=3, heads=2, head_dim=16, pos_embed_max_size=16,
                dual_attention_layers=(0,), vae_channels=(8, 8, 16, 16), vae_groups=8, vae_layers=2, image_size=64)

# SD3.5-large's sizes: CLIP-L, OpenCLIP bigG's text tower, T5-XXL, 38 blocks of 38 heads x 64.
FULL = SD3Sizes(clip_widths=(768, 1280), clip_layers=(12, 32), clip_heads=(12, 20), t5_width=4096, t5_layers=24,
                t5_heads=64, t5_head_width=64, t5_ff=10240, layers=38, heads=38, head_dim=64, pos_embed_max_size=192,
                dual_attention_layers=(), vae_channels=(128, 256, 512, 512), vae_groups=32, vae_layers=2,
                image_size=1024)

# CLIP-L's activation, then CLIP-G's.
CLIP_ACTIVATIONS = ("quick_gelu", "gelu")


class SD3Family(ModelFamily):
    name = "sd3"
    backbones = (Backbone("transformer", "transformer"),)
    tokenizer_folders = ("tokenizer", "tokenizer_2", "tokenizer_3")
    clip_tokenizers = ("tokenizer", "tokenizer_2")
    components = ("text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae")
    # As diffusers runs SD3.5: T5's activations overflow fp16.
    gpu_dtype = torch.bfloat16
    default_scheduler = "flow_euler"
    size_reason = "the model's VAE scale factor times its 2x2 latent patches"
    sizes = {"tiny": TINY, "full": FULL}
    level_table = LEVELS

    def pipeline_class(self):
        from diffusers import StableDiffusion3Pipeline

        return StableDiffusion3Pipeline

    def backbone_class(self):
        from diffusers import SD3Transformer2DModel

        return SD3Transformer2DModel

    # --- its networks -------------------------------------------------------------------------

    def networks(self, cache=None) -> list[Network]:
        return list(NETWORKS)

    def carries_adapters(self, graph: str) -> bool:
        """diffusers' SD3 LoRA loader writes into the transformer and both CLIP encoders, never T5."""
        return graph in ("transformer", "clip_l", "clip_g")

    # --- quantization --------------------------------------------------------------------------

    def scheduler_timestep(self, args: tuple, kwargs: dict):
        # StableDiffusion3Pipeline hands the transformer the scheduler's own timestep.
        return kwargs["timestep"]

    def pipeline_call_kwargs(self, pipe) -> dict:
        return {"max_sequence_length": text_tokens(pipe.tokenizer_3)}

    # --- export and engines --------------------------------------------------------------------

    def export_sizes(self, pipe, geometry) -> dict:
        return {"text_tokens": text_tokens(pipe.tokenizer_3)}

    def graph_specs(self, pipe, batch: int, geometry, latent: int, dtype, vae_dtype, cache=None) -> list:
        from ..graphs.specs import GraphSpec
        from ..quantize.quantizers import unsupported_quantizers

        transformer = pipe.transformer.to(dtype)
        config = transformer.config
        text = text_tokens(pipe.tokenizer_3)
        ids = torch.zeros(batch, TOKENS, dtype=torch.int32)
        args = (torch.randn(batch, config.in_channels, latent, latent, dtype=dtype),
                torch.randn(batch, TOKENS + text, config.joint_attention_dim, dtype=dtype),
                torch.randn(batch, config.pooled_projection_dim, dtype=dtype), torch.full((batch,), 500.0))
        vae = pipe.vae.to(vae_dtype)
        return [
            GraphSpec(CLIP_L, ClipGraph(pipe.text_encoder.to(dtype), penultimate=True, pooled=True), (ids,)),
            GraphSpec(CLIP_G, ClipGraph(pipe.text_encoder_2.to(dtype), penultimate=True, pooled=True), (ids,)),
            GraphSpec(T5, T5Graph(pipe.text_encoder_3.to(dtype)), (torch.zeros(batch, text, dtype=torch.int32),)),
            GraphSpec(VAE, VaeDecoderGraph(vae), (torch.randn(batch, vae.config.latent_channels, latent, latent,
                                                              dtype=vae_dtype),)),
            GraphSpec(TRANSFORMER, TransformerGraph(transformer), args,
                      on_meta=not unsupported_quantizers(transformer)),
        ]

    def profile_axis_sizes(self, graph: str, geometry, record: dict, trt) -> list[dict[str, int]]:
        """The latent's sides of this image size and T5's tokens as the export recorded them."""
        scale = record.get("vae_scale_factor", 8)
        return [sd3_axis_sizes(geometry.height // scale, geometry.width // scale, record["text_tokens"])] * 3

    # --- running it ----------------------------------------------------------------------------

    def torch_stages(self, pipe, dtype, cache=None) -> dict:
        from ..runtime.stages import TorchStage

        return {"clip_l": TorchStage(ClipGraph(pipe.text_encoder, penultimate=True, pooled=True), CLIP_L, dtype),
                "clip_g": TorchStage(ClipGraph(pipe.text_encoder_2, penultimate=True, pooled=True), CLIP_G, dtype),
                "t5": TorchStage(T5Graph(pipe.text_encoder_3), T5, dtype),
                "transformer": self.backbone_stage(pipe.transformer, dtype),
                "vae": TorchStage(VaeDecoderGraph(pipe.vae), VAE, next(pipe.vae.parameters()).dtype)}

    def backbone_stage(self, backbone, dtype):
        from ..runtime.stages import TorchStage

        return TorchStage(TransformerGraph(backbone), TRANSFORMER, dtype)

    def fuse_projections(self, backbone) -> None:
        """diffusers' fused projections, run by this family's processor: diffusers' own fused joint
        processor (0.42) skips SD3.5's q/k RMS norms and needs text tokens, which SD3.5-medium's
        image-only attn2 has none of."""
        for attn in backbone.modules():
            processor = self.fp8_attention_processor(attn)
            if processor is not None:
                attn.fuse_projections(fuse=True)
                attn.set_processor(processor)

    def use_family_forms(self, backbone) -> None:
        from ..runtime.step_modulations import use_step_modulations

        use_step_modulations(backbone)

    def generation_stages(self, pipe) -> dict:
        from ..runtime.step_modulations import modulations_stages

        return modulations_stages(pipe.transformer, ModulationsGraph(pipe.transformer), MODULATIONS_NETWORK)

    def fp8_attention_processor(self, attn):
        """The processor for the attention layers diffusers runs with its own JointAttnProcessor2_0."""
        from diffusers.models.attention_processor import JointAttnProcessor2_0

        return SD3TorchAttnProcessor() if type(getattr(attn, "processor", None)) is JointAttnProcessor2_0 else None

    def text_to_image(self, stages: dict, parts: dict, scheduler, device):
        return SD3TextToImage(stages, parts["tokenizers"], scheduler, types.SimpleNamespace(**parts["backbone_config"]),
                              vae_scale_factor(parts["vae_config"]), device)

    def size_multiple(self, vae_scale: int, backbone_config: dict | None = None) -> int:
        return vae_scale * (backbone_config or {}).get("patch_size", 2)

    # --- its architectures ---------------------------------------------------------------------

    def build_pipeline(self, sizes: SD3Sizes, tokenizers: dict | None = None):
        """CLIP-L, CLIP-G and T5 encoders, an SD3Transformer2DModel and a 16-channel AutoencoderKL
        with SD3's latent scaling and shift, and SD3's flow-matching scheduler (shift 3)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

        torch.manual_seed(SEED)
        tokenizers = tokenizers or {}
        clip_tokenizer = tokenizers.get("clip") or components.byte_level_tokenizer()
        t5_tokenizer = tokenizers.get("t5") or components.char_t5_tokenizer()
        clip_l, clip_g = (components.clip_text_encoder(clip_tokenizer, width, layers, heads, projection=True,
                                                       activation=activation)
                          for width, layers, heads, activation in zip(sizes.clip_widths, sizes.clip_layers,
                                                                      sizes.clip_heads, CLIP_ACTIVATIONS))
        t5 = components.t5_text_encoder(t5_tokenizer, sizes.t5_width, sizes.t5_layers, sizes.t5_heads,
                                        sizes.t5_head_width, sizes.t5_ff)
        latent_channels = 16
        vae_scale = 2 ** (len(sizes.vae_channels) - 1)
        transformer = SD3Transformer2DModel(
            sample_size=sizes.image_size // vae_scale, patch_size=2, in_channels=latent_channels,
            num_layers=sizes.layers, attention_head_dim=sizes.head_dim, num_attention_heads=sizes.heads,
            joint_attention_dim=sizes.t5_width, caption_projection_dim=sizes.heads * sizes.head_dim,
            pooled_projection_dim=sum(sizes.clip_widths), out_channels=latent_channels,
            pos_embed_max_size=sizes.pos_embed_max_size, dual_attention_layers=sizes.dual_attention_layers,
            qk_norm="rms_norm")
        vae = components.autoencoder(sizes.vae_channels, sizes.vae_groups, sizes.vae_layers, latent_channels,
                                     sizes.image_size, use_quant_conv=False, use_post_quant_conv=False,
                                     scaling_factor=1.5305, shift_factor=0.0609)
        return StableDiffusion3Pipeline(
            transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
            text_encoder=clip_l, tokenizer=clip_tokenizer, text_encoder_2=clip_g, tokenizer_2=clip_tokenizer,
            text_encoder_3=t5, tokenizer_3=t5_tokenizer)


SD3 = SD3Family()
