"""Wan2.2 text-to-video as model families: Wan2.2-T2V-A14B (two experts split at a noise boundary,
`wan`) and Wan2.2-TI2V-5B (one transformer whose timestep is expanded per token, a VAE of 48
channels that scales 16x, `wan_ti2v`): what the stages ask of them, over the package's graphs, data
flow, levels, architectures and scene model."""

from __future__ import annotations

import types

import torch

from ...errors import UserError
from ...graphs.geometry import SampleGeometry
from ..base import Backbone, HookCaching, ModelFamily
from .flow import (TEMPORAL_SCALE, UMT5_TOKENS, WanTextToVideo, latent_frames, latent_tokens, temporal_scale,
                   text_tokens)
from .graphs import UMT5, VIDEO_VAE, ExpertGraph, Umt5Graph, VideoDecoderGraph, WanTorchAttnProcessor, expert_network
from .recipe import LEVELS
from .scene import TrainWanSceneApp, scene_loss, scene_phases
from .sizes import FULL, TI2V_FULL, TI2V_TINY, TINY, build_pipeline

EXPERTS = (Backbone("transformer", "transformer"), Backbone("transformer_2", "transformer_2"))
# An expert's block list (WanTransformer3DModel.blocks), which diffusers' cache hooks step through.
BLOCK_STACKS = ("blocks",)


class WanFamily(HookCaching, ModelFamily):
    """Wan2.2 text-to-video: UMT5, one or two experts, the Wan VAE, UniPC over flow sigmas. Each
    model kind is a subclass that says its experts, timestep and defaults."""

    tokenizer_folders = ("tokenizer",)
    clip_tokenizers = ()
    hook_block_stacks = BLOCK_STACKS
    gpu_dtype = torch.bfloat16
    default_scheduler = "unipc"
    size_reason = "the VAE's spatial scale factor times the experts' 2x2 patches"
    level_table = LEVELS
    output = "video"
    channels_last = False
    # Its pipeline's switch to the second expert (a fraction of the training timesteps; None: one
    # expert throughout), whether its timestep is one per latent token, and its own geometry.
    boundary_ratio: float | None = None
    expand_timesteps = False
    default_frames: int
    default_fps: int
    default_size: tuple[int, int]
    # The guidance halves as two calls, as WanPipeline makes them: at the A14B's 75,600 tokens a
    # sample, its bf16 GEMMs on one sample's rows took 5.0 ms (5120 x 5120) where both halves' took
    # 11.5, 122 ms a block's step against 133 (H200, benchmarks/results/gemm_shapes_h200.json), and
    # its FP8 level-4 step 16.15 s against 16.25 in one call, its peak 49.7 GiB against 59.4
    # (benchmarks/results/wan_halves_h200.log).
    backbone_call_samples = 1

    @property
    def components(self) -> tuple[str, ...]:
        return ("text_encoder", *self.backbone_attributes, "vae")

    def pipeline_class(self):
        from diffusers import WanPipeline

        return WanPipeline

    def backbone_class(self):
        from diffusers import WanTransformer3DModel

        return WanTransformer3DModel

    # --- its networks -------------------------------------------------------------------------

    def networks(self, cache=None) -> list:
        return [UMT5, VIDEO_VAE, *(expert_network(backbone.graph) for backbone in self.backbones)]

    def carries_adapters(self, graph: str) -> bool:
        """diffusers' Wan LoRA loader writes into the transformers only."""
        return graph in self.backbone_graphs()

    # --- quantization --------------------------------------------------------------------------

    def scheduler_timestep(self, args: tuple, kwargs: dict):
        # WanPipeline hands each expert the scheduler's own timestep (per token where it expands it).
        return kwargs["timestep"]

    def pipeline_call_kwargs(self, pipe) -> dict:
        return {"max_sequence_length": text_tokens(pipe.tokenizer, UMT5_TOKENS)}

    def calibration_call_kwargs(self, block) -> dict:
        second = {} if block.guidance_scale_2 is None else {"guidance_scale_2": block.guidance_scale_2}
        return {"num_frames": block.num_frames, **second}

    # --- the sample's geometry and guidance -----------------------------------------------------

    def settled_frames(self, asked: int | None, key: str, model) -> int:
        """4k + 1 frames (the VAE keeps the first frame alone and packs 4 a latent frame after it), the
        model's own where none is asked."""
        frames = asked if asked is not None else (model.num_frames or self.default_frames)
        if frames < 1 or (frames - 1) % TEMPORAL_SCALE:
            near = max(1, (frames - 1) // TEMPORAL_SCALE * TEMPORAL_SCALE + 1)
            raise UserError(f"{key}={frames}: model={model.name}'s VAE takes 4k + 1 frames (1, 5, 9, ..., 81): "
                            f"choose {near} or {near + TEMPORAL_SCALE}")
        return frames

    def settled_fps(self, asked: int | None, key: str, model) -> int:
        fps = asked if asked is not None else (model.fps or self.default_fps)
        if fps < 1:
            raise UserError(f"{key}={fps}: give the frames per second the video plays at, 1 or more "
                            f"({model.name}'s own: {model.fps or self.default_fps})")
        return fps

    def native_size(self, model, configs: dict, vae_scale: int) -> tuple[int, int]:
        """A Wan folder states no size: the model config's, else the family's (MLPerf's 720x1280 for
        the A14B, the TI2V-5B's own 704x1280)."""
        return (model.height or self.default_size[0], model.width or self.default_size[1])

    def decoder_dtype(self, vae_config, dtype: torch.dtype) -> torch.dtype:
        """fp32 wherever the pipeline runs in half precision, as WanPipeline's documentation and
        MLPerf's reference load the Wan VAE (model.vae_dtype=bf16 decodes faster)."""
        return torch.float32

    def vae_scale(self, vae_config) -> int:
        # Configs saved before diffusers wrote the key are the Wan2.1 VAE's, which scales 8x.
        return vae_config.get("scale_factor_spatial", 8)

    def size_multiple(self, vae_scale: int) -> int:
        return vae_scale * 2

    # No fp8_attention_tokens limit: an A14B block's self-attention came 48.8% (relative) from its
    # fake quantization at 75,600 tokens (720p, 81 frames) on an H100 while Hopper's FP8 accumulator
    # lost the values' shared part; with their mean taken out on the GPU
    # (runtime.attention.Fp8Attention) it came 1.35% (tests/test_wan_gpu.py,
    # benchmarks/results/gpu_tests_wan_centred_h100.log), so FP8 attention runs at any length.

    def sequence_tokens(self, parts: dict, geometry) -> int:
        scale = self.vae_scale(parts["vae_config"])
        return latent_tokens(latent_frames(geometry.frames, temporal_scale(parts["vae_config"])),
                             geometry.height // scale, geometry.width // scale)

    # --- export and engines --------------------------------------------------------------------

    def graph_specs(self, pipe, batch: int, geometry: SampleGeometry, trace_latent: int, dtype, vae_dtype,
                    cache=None) -> list:
        """Every graph at the engines' geometry and batch (the experts' and the VAE's sizes are fixed
        when traced): UMT5 over the model's text length, each expert on both guidance halves."""
        from ...graphs.specs import GraphSpec
        from ...quantize.quantizers import unsupported_quantizers

        scale = pipe.vae_scale_factor_spatial
        shape = (latent_frames(geometry.frames, pipe.vae_scale_factor_temporal), geometry.height // scale,
                 geometry.width // scale)
        text = text_tokens(pipe.tokenizer, UMT5_TOKENS)
        samples = 2 * batch
        specs = [GraphSpec(UMT5, Umt5Graph(pipe.text_encoder.to(dtype)),
                           (torch.zeros(samples, text, dtype=torch.int32), torch.ones(samples, text, dtype=torch.int32))),
                 GraphSpec(VIDEO_VAE, VideoDecoderGraph(pipe.vae.to(vae_dtype)),
                           (torch.randn(batch, pipe.vae.config.z_dim, *shape, dtype=vae_dtype),))]
        for backbone in self.backbones:
            module = getattr(pipe, backbone.attribute).to(dtype)
            latent = torch.randn(samples, module.config.in_channels, *shape, dtype=dtype)
            tokens = latent_tokens(*shape)
            timestep = torch.full((samples, tokens) if self.expand_timesteps else (samples,), 500.0)
            specs.append(GraphSpec(expert_network(backbone.graph), ExpertGraph(module),
                                   (latent, timestep, torch.randn(samples, text, module.config.text_dim, dtype=dtype)),
                                   on_meta=not unsupported_quantizers(module)))
        return specs

    def traced_geometry_record(self, graph: str, geometry) -> dict:
        return {"traced_geometry": [geometry.frames, geometry.height, geometry.width]}

    def profile_axis_sizes(self, graph: str, geometry, record: dict, trt) -> list[dict[str, int]]:
        """Every axis is fixed in these graphs: nothing to size."""
        return [{}] * 3

    # --- running it ----------------------------------------------------------------------------

    def torch_stages(self, pipe, dtype, cache=None) -> dict:
        from ...runtime.stages import TorchStage

        modules = self.backbone_modules(pipe)
        experts = self.backbone_stages(modules, dtype) if cache is None else self.cache_stages(modules, dtype, cache)
        return {"umt5": TorchStage(Umt5Graph(pipe.text_encoder), UMT5, dtype), **experts,
                "vae": TorchStage(VideoDecoderGraph(pipe.vae), VIDEO_VAE, next(pipe.vae.parameters()).dtype)}

    def backbone_stages(self, modules: dict, dtype) -> dict:
        from ...runtime.stages import TorchStage

        return {backbone.graph: TorchStage(ExpertGraph(modules[backbone.attribute]), expert_network(backbone.graph),
                                           dtype) for backbone in self.backbones}

    def fp8_attention_processor(self, attn):
        """The processor for text-to-video attention layers diffusers runs with its WanAttnProcessor."""
        from diffusers.models.transformers.transformer_wan import WanAttnProcessor

        plain = type(attn.processor) is WanAttnProcessor and getattr(attn, "add_k_proj", None) is None
        return WanTorchAttnProcessor() if plain else None

    def text_to_image(self, stages: dict, parts: dict, scheduler, device):
        pipeline_config = parts.get("pipeline_config", {})
        boundary = pipeline_config.get("boundary_ratio", self.boundary_ratio) if len(self.backbones) > 1 else None
        return WanTextToVideo(stages, parts["tokenizers"], scheduler, types.SimpleNamespace(**parts["backbone_config"]),
                              parts["vae_config"], device, tuple(backbone.graph for backbone in self.backbones),
                              boundary, pipeline_config.get("expand_timesteps", self.expand_timesteps), UMT5_TOKENS)

    # --- its architectures (sizes.py) ----------------------------------------------------------

    def build_pipeline(self, sizes, tokenizers: dict | None = None):
        return build_pipeline(sizes, self.backbone_attributes, self.boundary_ratio, self.expand_timesteps, tokenizers)


class WanT2VFamily(WanFamily):
    """Wan2.2-T2V-A14B: two experts split at diffusers' boundary (0.875 of the training timesteps),
    MLPerf's text-to-video geometry by default (720x1280, 81 frames at 16 fps)."""

    name = "wan"
    backbones = EXPERTS
    sizes = {"tiny": TINY, "full": FULL}
    boundary_ratio = 0.875
    default_frames, default_fps, default_size = 81, 16, (720, 1280)
    scene_app = TrainWanSceneApp

    def fuse_projections(self, backbone) -> None:
        """Keeps q, k and v three GEMMs: at a video's 75,600 tokens the one GEMM three times as wide
        runs slower than the three (bf16, one video a call: 16.9 ms against 3 x 5.0 on an H200,
        benchmarks/results/gemm_shapes_h200.json; the TI2V-5B's 3072-wide one ran 2.3 ms against
        3 x 0.8, so it keeps diffusers' fusion)."""

    # --- the scene model (scene.py) -----------------------------------------------------------

    def scene_phases(self, pipe, latents: torch.Tensor, data, block, generator: torch.Generator) -> list:
        together = super().scene_phases(pipe, latents, data, block, generator)
        return scene_phases(pipe, latents, data, block, generator, self.backbone_attributes, together)

    def scene_loss(self, pipe, latents: torch.Tensor, data, block, generator: torch.Generator):
        return scene_loss(pipe, latents, data, block, generator, self.backbone_attributes)


class WanTI2VFamily(WanFamily):
    """Wan2.2-TI2V-5B: one transformer whose timestep is one per latent token (704x1280, 121 frames
    at 24 fps by default)."""

    name = "wan_ti2v"
    backbones = EXPERTS[:1]
    sizes = {"tiny": TI2V_TINY, "full": TI2V_FULL}
    expand_timesteps = True
    default_frames, default_fps, default_size = 121, 24, (704, 1280)


WAN = WanT2VFamily()
WAN_TI2V = WanTI2VFamily()
