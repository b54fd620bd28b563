"""Wan2.2 text-to-video as model families: Wan2.2-T2V-A14B (two experts split at a noise boundary,
`wan`) and Wan2.2-TI2V-5B (one transformer whose timestep is expanded per token, a VAE of 48
channels that scales 16x, `wan_ti2v`): what the stages ask of them, over the package's graphs, data
flow, levels, architectures and scene model."""

from __future__ import annotations

import types

import torch

from ...errors import UserError
from ...graphs.geometry import SampleGeometry
from ..base import Backbone, HookCaching, ModelFamily, Sample
from .flow import (TEMPORAL_SCALE, UMT5_TOKENS, WanTextToVideo, expert_at, latent_frames, latent_tokens,
                   temporal_scale, text_tokens)
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
    size_reason = "the VAE's spatial scale factor times the experts' patch size (patch_size in their config)"
    level_table = LEVELS
    output = "video"
    channels_last = False
    # The Wan VAE decodes a few frames a call, with a cache of the last in Python: compiled, the
    # 81-frame 720p decode took 47 s against 4.2 eager in bf16, its first call 104 s (H200,
    # benchmarks/results/wan_vae_h200.json), and a captured graph would hold its 11-22 GiB of
    # activations for good.
    compiles_decoder = False
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

    def _settled_frames(self, asked: int | None, key: str, model) -> int:
        """4k + 1 frames (the VAE keeps the first frame alone and packs 4 a latent frame after it), the
        model's own (model.num_frames, else the family's) where none is asked."""
        frames, key = _own(asked, key, model.num_frames, "model.num_frames", self.default_frames)
        if frames < 1 or (frames - 1) % TEMPORAL_SCALE:
            near = max(1, (frames - 1) // TEMPORAL_SCALE * TEMPORAL_SCALE + 1)
            raise UserError(f"{key}={frames}: model={model.name}'s VAE takes 4k + 1 frames (1, 5, 9, ..., 81): "
                            f"choose {near} or {near + TEMPORAL_SCALE}")
        return frames

    def _settled_fps(self, asked: int | None, key: str, model) -> int:
        fps, named = _own(asked, key, model.fps, "model.fps", self.default_fps)
        if fps < 1:
            own = f" ({model.name}'s own: {model.fps or self.default_fps})" if named == key else ""
            raise UserError(f"{named}={fps}: give the frames per second the video plays at, 1 or more{own}")
        return fps

    def _native_size(self, model, configs: dict, vae_scale: int) -> tuple[int, int]:
        """A Wan folder states no size: the model config's (model.height, model.width, refused where
        the experts' grid cannot make it), else the family's (MLPerf's 720x1280 for the A14B, the
        TI2V-5B's own 704x1280)."""
        from ...config import validate_image_size

        if configs:
            validate_image_size({"height": model.height, "width": model.width}, "model.",
                                self.size_multiple(vae_scale, configs["backbone_config"]), self.size_reason)
        return tuple(own if own is not None else default for own, default in zip((model.height, model.width),
                                                                                 self.default_size))

    def settle_sample(self, model, configs: dict, prefix: str, *asked) -> Sample:
        """The base's settling, and the geometry the experts' rotary tables can place: latent frames
        and patches a side at most rope_max_seq_len each."""
        sample = super().settle_sample(model, configs, prefix, *asked)
        if configs:
            self._check_positions(sample.geometry, configs, prefix, model)
        return sample

    def _check_positions(self, geometry: SampleGeometry, configs: dict, prefix: str, model) -> None:
        backbone, vae = configs["backbone_config"], configs["vae_config"]
        positions = backbone.get("rope_max_seq_len", 1024)
        _, patch_height, patch_width = backbone.get("patch_size", (1, 2, 2))
        scale, frame_scale = self.vae_scale(vae), temporal_scale(vae)
        placed = {"num_frames": (latent_frames(geometry.frames, frame_scale), "latent frames",
                                 frame_scale * (positions - 1) + 1),
                  "height": (geometry.height // (scale * patch_height), "patches a side", scale * patch_height * positions),
                  "width": (geometry.width // (scale * patch_width), "patches a side", scale * patch_width * positions)}
        for key, (count, what, most) in placed.items():
            if count > positions:
                raise UserError(f"{prefix}{key}={getattr(geometry, 'frames' if key == 'num_frames' else key)}: "
                                f"model={model.name}'s experts place at most {positions} {what} (rope_max_seq_len in "
                                f"its transformer config): choose {most} or less")

    def settle_guidance(self, model, prefix: str, guidance_scale: float | None,
                        guidance_scale_2: float | None) -> tuple[float, float | None]:
        """The base's, refusing a second expert's scale asked for a video whose guidance is off (a
        first scale of 1 or less turns classifier-free guidance off for the whole video, as
        WanPipeline decides it)."""
        scales = super().settle_guidance(model, prefix, guidance_scale, guidance_scale_2)
        if guidance_scale_2 is not None and scales[0] <= 1.0 < guidance_scale_2:
            raise UserError(f"{prefix}guidance_scale_2={guidance_scale_2} has no effect: guidance_scale={scales[0]} "
                            "turns guidance off for the whole video: set guidance_scale above 1, or leave "
                            f"{prefix}guidance_scale_2 unset")
        return scales

    def check_declared(self, model, parts: dict) -> None:
        """Refuses a folder whose VAE scales by nothing, whose experts place no position, or (two
        experts) whose boundary leaves one expert no step."""
        super().check_declared(model, parts)
        vae, backbone = parts["vae_config"], parts["backbone_config"]
        for key in ("scale_factor_spatial", "scale_factor_temporal"):
            if key in vae and not (isinstance(vae[key], int) and vae[key] >= 1):
                raise UserError(f"model.source={model.source}: its vae/config.json declares {key}={vae[key]!r}, "
                                "a Wan VAE's is a positive whole number (8 or 16 in space, 4 in time): fix the folder")
        positions = backbone.get("rope_max_seq_len", 1024)
        if not (isinstance(positions, int) and positions >= 1):
            raise UserError(f"model.source={model.source}: its transformer config declares rope_max_seq_len="
                            f"{positions!r}: fix the folder (Wan2.2's experts: 1024)")
        boundary = self.boundary_of(parts)
        if len(self.backbones) > 1 and (isinstance(boundary, bool) or not isinstance(boundary, (int, float))
                                        or not 0 < boundary < 1):
            raise UserError(f"model.source={model.source}: its model_index.json declares boundary_ratio={boundary!r}, "
                            "where one expert takes over from the other, a number between 0 and 1 (Wan2.2-T2V-A14B: "
                            "0.875): fix the folder")

    def boundary_of(self, parts: dict) -> float | None:
        """Where the second expert takes over, as a share of the training timesteps: the folder's
        boundary_ratio, else the family's (None: one expert throughout)."""
        if len(self.backbones) == 1:
            return None
        return parts.get("pipeline_config", {}).get("boundary_ratio", self.boundary_ratio)

    def backbone_steps(self, parts: dict, steps: int) -> dict[str, int]:
        """The steps of `steps` each expert serves: the first while t >= boundary x the training
        timesteps, as the data flow and WanPipeline split them."""
        from ..pipeline import make_scheduler

        scheduler = make_scheduler(self.default_scheduler, parts["scheduler_config"])
        scheduler.set_timesteps(steps)
        served = [expert_at(t, self.boundary_of(parts), scheduler.config.num_train_timesteps, len(self.backbones))
                  for t in scheduler.timesteps]
        return {backbone.attribute: served.count(index) for index, backbone in enumerate(self.backbones)}

    def decoder_dtype(self, vae_config, dtype: torch.dtype) -> torch.dtype:
        """fp32 wherever the pipeline runs in half precision, as WanPipeline's documentation and
        MLPerf's reference load the Wan VAE (model.vae_dtype=bf16 decodes faster)."""
        return torch.float32

    def vae_scale(self, vae_config) -> int:
        # Configs saved before diffusers wrote the key are the Wan2.1 VAE's, which scales 8x.
        return vae_config.get("scale_factor_spatial", 8)

    def size_multiple(self, vae_scale: int, backbone_config: dict | None = None) -> int:
        """The VAE's spatial scale times the experts' patches (patch_size, 1x2x2 in Wan2.2's)."""
        patch = (backbone_config or {}).get("patch_size", (1, 2, 2))
        return vae_scale * max(patch[1:])

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

    def frame_attention_blocks(self, backbone_config: dict) -> int:
        return backbone_config["num_layers"]

    def frame_attention_layers(self, backbone) -> dict:
        return {index: block.attn1 for index, block in enumerate(backbone.blocks)}

    def tokens_per_frame(self, backbone, hidden_states: torch.Tensor) -> int:
        """The latent (batch, channels, frames, height, width) in 1x2x2 patches (patch_size):
        (height / 2) x (width / 2) tokens a frame, frame after frame."""
        _, patch_height, patch_width = backbone.config.patch_size
        return (hidden_states.shape[-2] // patch_height) * (hidden_states.shape[-1] // patch_width)

    def fp8_attention_processor(self, attn):
        """The processor for text-to-video attention layers diffusers runs with its WanAttnProcessor."""
        from diffusers.models.transformers.transformer_wan import WanAttnProcessor

        plain = type(attn.processor) is WanAttnProcessor and getattr(attn, "add_k_proj", None) is None
        return WanTorchAttnProcessor() if plain else None

    def text_to_image(self, stages: dict, parts: dict, scheduler, device):
        pipeline_config = parts.get("pipeline_config", {})
        boundary = self.boundary_of(parts)
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


def _own(asked, key: str, own, own_key: str, default) -> tuple:
    """The value a run takes and the key that named it: the one asked for, else the model config's
    (`own`, named `own_key`), else the family's `default`."""
    if asked is not None:
        return asked, key
    return (own, own_key) if own is not None else (default, key)
