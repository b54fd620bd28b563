"""Wan2.2 text-to-video as model families: Wan2.2-T2V-A14B (two experts split at a noise boundary,
`wan`) and Wan2.2-TI2V-5B (one transformer whose timestep is expanded per token, a VAE of 48
channels that scales 16x, `wan_ti2v`), with their graphs, levels, data flow and architectures."""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch

from ...errors import UserError
from ...graphs.geometry import SampleGeometry
from ...quantize.recipe import LayerGroup, LevelTable
from .. import components
from ..base import SEED, Backbone, HookCaching, ModelFamily, Sample
from .flow import (TEMPORAL_SCALE, WanTextToVideo, expert_at, latent_frames, latent_tokens, temporal_scale,
                   text_tokens)
from .graphs import UMT5, VIDEO_VAE, ExpertGraph, Umt5Graph, VideoDecoderGraph, WanTorchAttnProcessor, expert_network

# WanPipeline's UMT5 sequence (its max_sequence_length default in __call__).
UMT5_TOKENS = 512
# The experts' levels: every layer of their blocks is a Linear (the patch embedding, a Conv3d, stays
# in 16 bits), so there is no level 1: 2 the feed-forward layers; 2.5 + the q/k/v projections of the
# self- and cross-attention; 3 + the rest (attention outputs); 4 = 3 + FP8 self-attention (attn1, over
# the video's 75,600 tokens at 720p: 1.44x bf16 attention in cuDNN's FP8 kernel on an H100); the
# cross-attention over UMT5's 512 tokens stays 16-bit. High precision, as ModelOpt's Wan filter
# keeps them: the patch, text and time embedders (condition_embedder), the output projection, and
# the first and last three of the A14B's 40 blocks (a 30-block TI2V-5B keeps its first three, as
# ModelOpt's literal block numbers do); the norms (which ModelOpt leaves to its default config).
HIGH_PRECISION = ("patch_embedding*", "condition_embedder*", "proj_out*", "*norm*",
                  *(f"blocks.{index}.*" for index in (0, 1, 2, 37, 38, 39)))
LEVELS = LevelTable(
    levels=(2.0, 2.5, 3.0, 4.0),
    groups=(LayerGroup(2.0, "*.ffn.net.*", "nn.Linear"), LayerGroup(2.5, "*.attn[12].to_[qkv].", "nn.Linear"),
            LayerGroup(3.0, "*", "nn.Linear")),
    high_precision=HIGH_PRECISION,
    qkv_level=2.5,
    attention_scope="*.attn1.",
)


@dataclass(frozen=True)
class WanSizes:
    """A Wan architecture: UMT5, each expert, the Wan VAE, and the scheduler's flow shift."""

    text_width: int
    text_layers: int
    text_heads: int
    text_head_width: int
    text_ff: int
    heads: int
    head_dim: int
    ffn: int
    layers: int
    latent_channels: int
    freq_dim: int
    rope_max_tokens: int
    # AutoencoderKLWan's arguments (lists where it takes lists), as (name, value) pairs.
    vae: tuple
    flow_shift: float
    # The tokenizer's length, which the UMT5 sequence takes (WanPipeline's 512 for the real models).
    text_tokens: int = UMT5_TOKENS


TINY = WanSizes(text_width=32, text_layers=2, text_heads=4, text_head_width=8, text_ff=64, heads=2, head_dim=16,
                ffn=64, layers=5, latent_channels=16, freq_dim=32, rope_max_tokens=64, flow_shift=3.0, text_tokens=64,
                vae=(("base_dim", 8), ("z_dim", 16), ("dim_mult", [1, 1, 1, 1]), ("num_res_blocks", 1),
                     ("temperal_downsample", [False, True, True])))
# Wan2.2-T2V-A14B: each expert 40 blocks of 40 heads of 128 (14.3 B parameters), UMT5-XXL, the Wan2.1 VAE
# (AutoencoderKLWan's defaults), UniPC with diffusers' flow shift of 3.
FULL = WanSizes(text_width=4096, text_layers=24, text_heads=64, text_head_width=64, text_ff=10240, heads=40,
                head_dim=128, ffn=13824, layers=40, latent_channels=16, freq_dim=256, rope_max_tokens=1024,
                flow_shift=3.0, vae=())
# The Wan2.2 VAE's 48 latent channels as random weights take them (a trained VAE's folder states its
# own per-channel mean and std).
UNIT_STATISTICS_48 = (("latents_mean", [0.0] * 48), ("latents_std", [1.0] * 48))
# Wan2.2-TI2V-5B: 30 blocks of 24 heads of 128, 48 latent channels, the Wan2.2 VAE (16x, residual,
# 2x2 pixel patches), flow shift 5.
TI2V_FULL = WanSizes(text_width=4096, text_layers=24, text_heads=64, text_head_width=64, text_ff=10240, heads=24,
                     head_dim=128, ffn=14336, layers=30, latent_channels=48, freq_dim=256, rope_max_tokens=1024,
                     flow_shift=5.0,
                     vae=(("base_dim", 160), ("decoder_base_dim", 256), ("z_dim", 48), ("is_residual", True),
                          ("in_channels", 12), ("out_channels", 12), ("patch_size", 2), ("scale_factor_spatial", 16),
                          *UNIT_STATISTICS_48))
TI2V_TINY = WanSizes(text_width=32, text_layers=2, text_heads=4, text_head_width=8, text_ff=64, heads=2, head_dim=16,
                     ffn=64, layers=5, latent_channels=48, freq_dim=32, rope_max_tokens=64, flow_shift=5.0,
                     text_tokens=64,
                     vae=(("base_dim", 8), ("decoder_base_dim", 12), ("z_dim", 48), ("is_residual", True),
                          ("in_channels", 12), ("out_channels", 12), ("patch_size", 2), ("scale_factor_spatial", 16),
                          ("dim_mult", [1, 1, 1, 1]), ("num_res_blocks", 1),
                          ("temperal_downsample", [False, True, True]), *UNIT_STATISTICS_48))


def scene_sizes(arch) -> WanSizes:
    """The Wan scene model's architecture (config's WanSceneArchitecture): UMT5 with heads of 32, a
    Wan VAE of 16 channels whose levels after the first each halve the sides (the last
    vae_frame_levels also the frames), unit latent statistics that training replaces with the
    latents' own, and the A14B's flow shift."""
    levels = len(arch.vae_dim_mult) - 1
    frame_levels = arch.vae_frame_levels
    return WanSizes(text_width=arch.text_width, text_layers=arch.text_layers, text_heads=arch.text_width // 32,
                    text_head_width=32, text_ff=2 * arch.text_width, heads=arch.heads, head_dim=arch.head_dim,
                    ffn=arch.ffn, layers=arch.layers, latent_channels=16, freq_dim=128, rope_max_tokens=64,
                    flow_shift=3.0,
                    vae=(("base_dim", arch.vae_base), ("z_dim", 16), ("dim_mult", list(arch.vae_dim_mult)),
                         ("num_res_blocks", arch.vae_res_blocks), ("temperal_downsample", [False] * (levels - frame_levels) + [True] * frame_levels),
                         # WanPipeline sizes its latent frames by this, not by the levels.
                         ("scale_factor_spatial", 2 ** levels), ("scale_factor_temporal", 2 ** frame_levels),
                         ("latents_mean", [0.0] * 16), ("latents_std", [1.0] * 16)))


def umt5_encoder(tokenizer, sizes: WanSizes):
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=sizes.text_width, d_kv=sizes.text_head_width, d_ff=sizes.text_ff,
        num_layers=sizes.text_layers, num_heads=sizes.text_heads, feed_forward_proj="gated-gelu",
        is_encoder_decoder=False, use_cache=False))


def expert(sizes: WanSizes):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=sizes.heads, attention_head_dim=sizes.head_dim,
        in_channels=sizes.latent_channels, out_channels=sizes.latent_channels, text_dim=sizes.text_width,
        freq_dim=sizes.freq_dim, ffn_dim=sizes.ffn, num_layers=sizes.layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=sizes.rope_max_tokens)


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
        model's own (model.num_frames, else the family's) where none is asked."""
        frames, key = _own(asked, key, model.num_frames, "model.num_frames", self.default_frames)
        if frames < 1 or (frames - 1) % TEMPORAL_SCALE:
            near = max(1, (frames - 1) // TEMPORAL_SCALE * TEMPORAL_SCALE + 1)
            raise UserError(f"{key}={frames}: model={model.name}'s VAE takes 4k + 1 frames (1, 5, 9, ..., 81): "
                            f"choose {near} or {near + TEMPORAL_SCALE}")
        return frames

    def settled_fps(self, asked: int | None, key: str, model) -> int:
        fps, named = _own(asked, key, model.fps, "model.fps", self.default_fps)
        if fps < 1:
            own = f" ({model.name}'s own: {model.fps or self.default_fps})" if named == key else ""
            raise UserError(f"{named}={fps}: give the frames per second the video plays at, 1 or more{own}")
        return fps

    def native_size(self, model, configs: dict, vae_scale: int) -> tuple[int, int]:
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

    # --- its architectures ---------------------------------------------------------------------

    def build_pipeline(self, sizes: WanSizes, tokenizers: dict | None = None):
        """UMT5, the experts and the Wan VAE at `sizes`, with UniPC over flow sigmas."""
        from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

        torch.manual_seed(SEED)
        tokenizer = (tokenizers or {}).get("t5") or components.char_t5_tokenizer(sizes.text_tokens)
        experts = {backbone.attribute: expert(sizes) for backbone in self.backbones}
        scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                            num_train_timesteps=1000, flow_shift=sizes.flow_shift)
        boundary = {"boundary_ratio": self.boundary_ratio} if len(self.backbones) > 1 else {}
        return WanPipeline(tokenizer=tokenizer, text_encoder=umt5_encoder(tokenizer, sizes),
                           vae=AutoencoderKLWan(**dict(sizes.vae)), scheduler=scheduler,
                           expand_timesteps=self.expand_timesteps, **experts, **boundary)


class WanT2VFamily(WanFamily):
    """Wan2.2-T2V-A14B: two experts split at diffusers' boundary (0.875 of the training timesteps),
    MLPerf's text-to-video geometry by default (720x1280, 81 frames at 16 fps)."""

    name = "wan"
    backbones = EXPERTS
    sizes = {"tiny": TINY, "full": FULL}
    boundary_ratio = 0.875
    default_frames, default_fps, default_size = 81, 16, (720, 1280)
    scene_tokenizers = ("t5",)

    def fuse_projections(self, backbone) -> None:
        """Keeps q, k and v three GEMMs: at a video's 75,600 tokens the one GEMM three times as wide
        runs slower than the three (bf16, one video a call: 16.9 ms against 3 x 5.0 on an H200,
        benchmarks/results/gemm_shapes_h200.json; the TI2V-5B's 3072-wide one ran 2.3 ms against
        3 x 0.8, so it keeps diffusers' fusion)."""

    # --- the scene model -----------------------------------------------------------------------

    def scene_sizes(self, arch, image_size: int) -> WanSizes:
        return scene_sizes(arch)

    def scene_phases(self, pipe, latents: torch.Tensor, data, block, generator: torch.Generator) -> list:
        """With denoiser.shared_steps, the first expert and UMT5 learn every noise level first (one
        expert's cost a step, where the experts would each learn the captions' binding apart), then
        both experts start from its weights and learn their own shares together."""
        from ..training import ScenePhase

        together = super().scene_phases(pipe, latents, data, block, generator)
        if not block.shared_steps:
            return together
        first, *others = self.backbone_modules(pipe).values()

        def share() -> None:
            for other in others:
                other.load_state_dict(first.state_dict())

        alone = ScenePhase(f"{self.backbone_attributes[0]} at every noise level", [pipe.text_encoder, first],
                           self.scene_loss(pipe, latents, data, block, generator, everywhere=True),
                           block.shared_steps, share)
        return [alone, *together]

    def scene_loss(self, pipe, latents: torch.Tensor, data, block, generator: torch.Generator,
                   everywhere: bool = False):
        """Each expert predicts the velocity (noise minus clip) of the straight path from the clip's
        latent to noise, on its own share of the noise levels as the A14B's experts serve them: the
        first from the pipeline's boundary up, the second below it (`everywhere`: the first alone,
        on every level). Within each share the levels are drawn as the sampler steps through them:
        uniform before the scheduler's flow shift, then shifted, so the pure noise a video starts
        from and the levels either side of the boundary are trained as often as the sampler visits
        them. Both experts see the same clips and captions each step (UMT5 runs once), each with its
        own noise; UMT5's states go in as the pipeline feeds them (zero past each caption), a dropped
        caption being the empty one, WanPipeline's negative prompt."""
        import torch.nn.functional as F

        from ..training import autocast, kept

        device = latents.device
        experts = list(self.backbone_modules(pipe).values())
        config = pipe.scheduler.config
        shift, train_steps = config.flow_shift, config.num_train_timesteps

        def unshifted(sigma: float) -> float:
            return sigma / (shift - (shift - 1) * sigma)

        boundary = unshifted(pipe.config.boundary_ratio)
        shares = [(0.0, 1.0)] if everywhere else [(boundary, 1.0), (0.0, boundary)]
        encoder = Umt5Graph(pipe.text_encoder)
        pad = pipe.tokenizer.pad_token_id

        def expert_loss(expert, share: tuple[float, float], clean: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
            noise = torch.randn(clean.shape, device=device, generator=generator)
            low, high = share
            drawn = low + (high - low) * torch.rand(len(clean), device=device, generator=generator)
            sigma = shift * drawn / (1 + (shift - 1) * drawn)
            noisy = clean + sigma.view(-1, 1, 1, 1, 1) * (noise - clean)
            with autocast(device):
                velocity = expert(hidden_states=noisy, timestep=sigma * train_steps, encoder_hidden_states=text,
                                  return_dict=False)[0]
            return F.mse_loss(velocity.float(), noise - clean)

        def loss_of(indices: torch.Tensor) -> torch.Tensor:
            ids = torch.where(kept(block, generator, device)[:, None], data.token_ids["t5"][indices],
                              data.empty_ids["t5"])
            with autocast(device):
                text = encoder(ids, (ids != pad).long())
            return sum(expert_loss(expert, share, latents[indices], text)
                       for expert, share in zip(experts, shares)) / len(shares)

        return loss_of


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
