"""Stable Diffusion 1.5 / 2.x: graphs clip1, unet, vae (NeMo's names; the UNet takes x, timesteps
and context), the UNet's quant levels, DeepCache, the text-to-image data flow of diffusers'
StableDiffusionPipeline and its architectures. SDXL (sdquant.families.sdxl) extends it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from dataclasses import dataclass

import torch

from ..quantize.recipe import LayerGroup, LevelTable
from . import components
from .base import SEED, Backbone, ModelFamily, vae_scale_factor
from .deep_cache import DEEP, FULL, SHALLOW, DeepCache, deep_sizes
from .encoders import ClipGraph, VaeDecoderGraph, clip_network
from ..graphs.networks import BATCH, CONTEXT, HEIGHT, LATENT, TOKENS, VAE, WIDTH, Network, Role
from .pipeline import SamplingSettings, TextToImage, dropped_words, prompt_windows, say_truncated

# Layers whose ranges are too wide, or whose error spreads to every pixel, for 8 bits.
HIGH_PRECISION = ("*time_embedding*", "*time_emb_proj*", "*add_embedding*", "*conv_in*", "*conv_out*",
                  "*conv_shortcut*", "*norm*")
# NeMo's levels: 1 convolutions, 2 + feed-forward Linear, 2.5 + attention q/k/v, 3 every Linear,
# 4 = 3 + FP8 self-attention (attn1). Cross-attention (attn2) stays in 16 bits at level 4: its 77
# keys give FP8 attention nothing to gain (cuDNN's FP8 kernel ran it at 0.59x the speed of fp16
# attention on an H100), so fake quantization, the export and the torch backend's kernel all keep
# it as it is.
LEVELS = LevelTable(
    levels=(1.0, 2.0, 2.5, 3.0, 4.0),
    groups=(LayerGroup(1.0, "*", "nn.Conv2d"), LayerGroup(2.0, "*.ff.net.*", "nn.Linear"),
            LayerGroup(2.5, "*.to_[qkv].", "nn.Linear"), LayerGroup(3.0, "*", "nn.Linear")),
    high_precision=HIGH_PRECISION,
    qkv_level=2.5,
    attention_scope="*.attn1.",
)


def unet_network(name: str, pooled_input: bool) -> Network:
    """x, timesteps, context and (SDXL) y, NeMo's pooled text embedding joined to the Fourier-embedded
    time ids -> the noise prediction."""
    inputs = {"x": LATENT, "timesteps": {0: BATCH}, "context": {0: BATCH, 1: CONTEXT}}
    if pooled_input:
        inputs["y"] = {0: BATCH}
    return Network(name, inputs, {"out": LATENT}, role=Role.backbone, guided=True, kept_precision=("timesteps",))


class UNetGraph(torch.nn.Module):
    """The UNet with NeMo's inputs: x, timesteps, context, and for SDXL y (the add-embedding's input)."""

    # The Fourier time embedding builds its frequencies with arange on the timesteps' device: on
    # the meta device they would have no values, so for a meta trace the timesteps stay on the CPU
    # and only their embedding moves to meta.
    host_inputs = ("timesteps",)

    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def host_modules(self) -> list[torch.nn.Module]:
        return [self.unet.time_proj]

    def forward(self, x, timesteps, context, y=None):
        if y is None:
            return self.unet(x, timesteps, encoder_hidden_states=context, return_dict=False)[0]
        with y_conditioning(self.unet):
            return self.unet(x, timesteps, encoder_hidden_states=context, added_cond_kwargs={"y": y},
                             return_dict=False)[0]


@contextlib.contextmanager
def y_conditioning(unet):
    """Makes the SDXL UNet take ``y`` as its add_embedding input, as NeMo's graph does."""

    def aug_embed_from_y(self, emb, encoder_hidden_states, added_cond_kwargs):
        return self.add_embedding(added_cond_kwargs["y"].to(emb.dtype))

    unet.get_aug_embed = types.MethodType(aug_embed_from_y, unet)
    try:
        yield unet
    finally:
        del unet.get_aug_embed


@dataclass(frozen=True)
class UNetSizes:
    """An SD or SDXL architecture: its text encoders (one for SD, two for SDXL), UNet and VAE."""

    text_widths: tuple[int, ...]
    text_layers: tuple[int, ...]
    text_heads: tuple[int, ...]
    unet_channels: tuple[int, ...]
    unet_down: tuple[str, ...]
    unet_up: tuple[str, ...]
    unet_transformer_layers: tuple[int, ...] | int
    unet_head_dims: tuple[int, ...]
    unet_groups: int
    vae_channels: tuple[int, ...]
    vae_groups: int
    vae_layers: int
    image_size: int
    # SDXL's text-time embedding width (the Fourier features of each of the six time ids).
    time_id_width: int = 0
    # The VAE's latent scaling (a scene model's is set by its training) and whether diffusers runs
    # it in fp32 for a half-precision pipeline.
    vae_config: tuple = (("scaling_factor", 0.13025),)

    @property
    def latent_size(self) -> int:
        return self.image_size // 2 ** (len(self.vae_channels) - 1)


def build_unet(sizes: UNetSizes, cross_attention_dim: int, **extra):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=sizes.latent_size, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=sizes.unet_channels, down_block_types=sizes.unet_down, up_block_types=sizes.unet_up,
        attention_head_dim=sizes.unet_head_dims, cross_attention_dim=cross_attention_dim,
        norm_num_groups=sizes.unet_groups, **extra)


def sd_scheduler():
    """SD's and SDXL's scaled-linear DDPM schedule, sampled by Euler with SDXL's spacing."""
    from diffusers import EulerDiscreteScheduler

    return EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                  timestep_spacing="leading", steps_offset=1)


def unet_vae(sizes: UNetSizes):
    return components.autoencoder(sizes.vae_channels, sizes.vae_groups, sizes.vae_layers, 4, sizes.image_size,
                                  **dict(sizes.vae_config))


TINY = UNetSizes(
    text_widths=(32,), text_layers=(3,), text_heads=(4,), unet_channels=(32, 64),
    unet_down=("DownBlock2D", "CrossAttnDownBlock2D"), unet_up=("CrossAttnUpBlock2D", "UpBlock2D"),
    unet_transformer_layers=(1, 2), unet_head_dims=(2, 4), unet_groups=16, vae_channels=(8, 8, 16, 16),
    vae_groups=8, vae_layers=1, image_size=64)


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
        from ..progress import Progress

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


def unet_axis_sizes(latent_height: int, latent_width: int, windows: int, branch: int | None) -> dict[str, int]:
    """The UNet graphs' axes: the latent's sides, the context's CLIP windows and, for a cached
    pass, its feature's sides."""
    deep = {} if branch is None else deep_sizes(latent_height, latent_width, branch)
    return {HEIGHT: latent_height, WIDTH: latent_width, CONTEXT: windows * TOKENS, **deep}


class UNetFp8AttnProcessor:
    """diffusers' AttnProcessor2_0 for the attention of a UNet's transformer blocks (no group or
    spatial norm, q/k norm, residual or output rescale) on a layer the torch backend converted to
    FP8: fused projections, and FP8 attention where the layer has its ranges."""

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, temb: torch.Tensor | None = None) -> torch.Tensor:
        from ..quantize.shared_ranges import KV, QKV
        from ..runtime.attention import attend, no_mask, project

        no_mask(attention_mask)
        if attn.is_cross_attention:
            context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
            query, (key, value) = attn.to_q(hidden_states), project(attn, context, KV)
        else:
            query, key, value = project(attn, hidden_states, QKV)
        out = attend(attn, *(x.unflatten(-1, (attn.heads, -1)) for x in (query, key, value)))
        return attn.to_out[1](attn.to_out[0](out))


class StableDiffusionFamily(ModelFamily):
    """SD 1.5 and 2.x: one CLIP text encoder, a UNet without add-embeddings, an AutoencoderKL."""

    name = "sd"
    backbones = (Backbone("unet", "unet"),)
    tokenizer_folders = ("tokenizer",)
    clip_tokenizers = ("tokenizer",)
    components = ("text_encoder", "unet", "vae")
    cache_methods = ("none", "deepcache")
    default_scheduler = "euler"
    sizes = {"tiny": TINY}
    level_table = LEVELS
    # The second CLIP encoder and its pooled embedding are SDXL's.
    pooled_input = False
    text_to_image_class = SDTextToImage

    def pipeline_class(self):
        from diffusers import StableDiffusionPipeline

        return StableDiffusionPipeline

    def backbone_class(self):
        from diffusers import UNet2DConditionModel

        return UNet2DConditionModel

    # --- its networks -------------------------------------------------------------------------

    def text_networks(self) -> list[Network]:
        return [dataclasses.replace(clip_network("clip1"), guided=True)]

    @property
    def unet_graph(self) -> str:
        return self.backbones[0].graph

    def unet(self) -> Network:
        return unet_network(self.unet_graph, self.pooled_input)

    def cached_passes(self) -> tuple[Network, Network]:
        from .deep_cache import passes

        return passes(self.unet())

    def networks(self, cache=None) -> list[Network]:
        cached = list(self.cached_passes()) if cache is not None else []
        return [*self.text_networks(), VAE, self.unet(), *cached]

    def network(self, name: str) -> Network:
        return {each.name: each for each in (*self.text_networks(), VAE, self.unet(), *self.cached_passes())}[name]

    def cached_graphs(self) -> tuple[str, ...]:
        return tuple(network.name for network in self.cached_passes())

    # --- quantization --------------------------------------------------------------------------

    def scheduler_timestep(self, args: tuple, kwargs: dict):
        return kwargs["timestep"] if "timestep" in kwargs else args[1]

    # --- export and engines --------------------------------------------------------------------

    def text_graph_specs(self, pipe, ids: torch.Tensor, dtype) -> list:
        from ..graphs.specs import GraphSpec

        return [GraphSpec(self.text_networks()[0], ClipGraph(pipe.text_encoder.to(dtype), penultimate=False), (ids,))]

    def unet_args(self, unet, batch: int, latent: int, dtype) -> tuple:
        args = [torch.randn(batch, 4, latent, latent, dtype=dtype), torch.full((batch,), 500.0),
                torch.randn(batch, TOKENS, unet.config.cross_attention_dim, dtype=dtype)]
        if self.pooled_input:
            args.append(torch.randn(batch, unet.config.projection_class_embeddings_input_dim, dtype=dtype))
        return tuple(args)

    def graph_specs(self, pipe, batch: int, geometry, latent: int, dtype, vae_dtype, cache=None) -> list:
        from ..graphs.specs import GraphSpec
        from ..quantize.quantizers import unsupported_quantizers
        from .deep_cache import FullPass, ShallowPass

        ids = torch.zeros(batch, TOKENS, dtype=torch.int32)
        vae = pipe.vae.to(vae_dtype)
        unet = pipe.unet.to(dtype)
        args = self.unet_args(unet, batch, latent, dtype)
        on_meta = not unsupported_quantizers(unet)
        specs = [*self.text_graph_specs(pipe, ids, dtype),
                 GraphSpec(VAE, VaeDecoderGraph(vae), (torch.randn(batch, 4, latent, latent, dtype=vae_dtype),)),
                 GraphSpec(self.unet(), UNetGraph(unet), args, on_meta=on_meta)]
        if cache is not None:
            full, shallow = self.cached_passes()
            sizes = deep_sizes(latent, latent, cache.branch)
            deep = torch.randn(batch, unet.config.block_out_channels[cache.branch + 1], *sizes.values(), dtype=dtype)
            specs += [GraphSpec(full, FullPass(unet, cache.branch), args, on_meta=on_meta),
                      GraphSpec(shallow, ShallowPass(unet, cache.branch), (*args, deep), on_meta=on_meta)]
        return specs

    def profile_axis_sizes(self, graph: str, geometry, record: dict, trt) -> list[dict[str, int]]:
        """Context from one CLIP window up to trt.max_prompt_chunks of them (long prompts encoded window
        by window); a cached pass's feature from the branch its export recorded."""
        scale = record["vae_scale_factor"]
        branch = record.get("deep_cache_branch")
        return [unet_axis_sizes(geometry.height // scale, geometry.width // scale, windows, branch)
                for windows in (1, 1, trt.max_prompt_chunks)]

    # --- running it ----------------------------------------------------------------------------

    def step_cache(self, block):
        if block.method == "none":
            return None
        return DeepCache(block.interval, block.branch)

    def fp8_attention_processor(self, attn):
        """The UNet's processor for attention layers diffusers runs with its plain AttnProcessor2_0."""
        from diffusers.models.attention_processor import AttnProcessor2_0

        plain = (type(attn.processor) is AttnProcessor2_0 and attn.spatial_norm is None and attn.group_norm is None
                 and attn.norm_cross is None and attn.norm_q is None and attn.norm_k is None
                 and not attn.residual_connection and attn.rescale_output_factor == 1.0)
        return UNetFp8AttnProcessor() if plain else None

    def torch_stages(self, pipe, dtype, cache=None) -> dict:
        from ..runtime.stages import TorchStage

        stages = {network.name: TorchStage(graph, network, dtype)
                  for network, graph in self.text_graphs(pipe)}
        stages["vae"] = TorchStage(VaeDecoderGraph(pipe.vae), VAE, next(pipe.vae.parameters()).dtype)
        stages[self.unet_graph] = self.backbone_stage(pipe.unet, dtype)
        if cache is not None:
            stages.update(self.cache_stages(self.backbone_modules(pipe), dtype, cache))
        return stages

    def text_graphs(self, pipe) -> list[tuple[Network, torch.nn.Module]]:
        return [(self.text_networks()[0], ClipGraph(pipe.text_encoder, penultimate=False))]

    def backbone_stage(self, backbone, dtype):
        from ..runtime.stages import TorchStage

        return TorchStage(UNetGraph(backbone), self.unet(), dtype)

    def cache_stages(self, modules: dict, dtype, cache) -> dict:
        from ..runtime.stages import TorchStage
        from .deep_cache import FullPass, ShallowPass

        backbone = modules[self.backbones[0].attribute]
        full, shallow = self.cached_passes()
        return {full.name: TorchStage(FullPass(backbone, cache.branch), full, dtype),
                shallow.name: TorchStage(ShallowPass(backbone, cache.branch), shallow, dtype)}

    def text_to_image(self, stages: dict, parts: dict, scheduler, device):
        return self.text_to_image_class(stages, parts["tokenizers"], scheduler,
                                        types.SimpleNamespace(**parts["backbone_config"]),
                                        vae_scale_factor(parts["vae_config"]), device, self.unet_graph)

    # --- its architectures ---------------------------------------------------------------------

    def build_pipeline(self, sizes: UNetSizes, tokenizers: dict | None = None):
        from diffusers import StableDiffusionPipeline

        torch.manual_seed(SEED)
        tokenizer = (tokenizers or {}).get("clip") or components.byte_level_tokenizer()
        return StableDiffusionPipeline(
            vae=unet_vae(sizes),
            text_encoder=components.clip_text_encoder(tokenizer, sizes.text_widths[0], sizes.text_layers[0],
                                                      sizes.text_heads[0]),
            tokenizer=tokenizer, unet=build_unet(sizes, sizes.text_widths[0]), scheduler=sd_scheduler(),
            safety_checker=None, feature_extractor=None, requires_safety_checker=False)


SD = StableDiffusionFamily()
