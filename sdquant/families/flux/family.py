"""Flux.1 as a model family: what the stages ask of it (graphs, export sizes, engine profiles, torch
stages and forms, data flow, native size), over its package's graphs, flow, levels, sizes and scene."""

from __future__ import annotations

import types

import torch

from ..base import Backbone, HookCaching, ModelFamily, vae_scale_factor
from ..encoders import ClipGraph, T5Graph, VaeDecoderGraph
from ...graphs.networks import TOKENS, VAE, Network
from ..dit import OwnT5Length, adaln_norms
from .flow import T5_TOKENS, FluxTextToImage, flux_axis_sizes
from .graphs import (CLIP, T5, FluxTorchAttnProcessor, ModulationsGraph, TransformerGraph, modulations_network,
                     transformer_network, use_rotary_halves)
from .recipe import LEVELS
from .scene import TrainFluxSceneApp, scene_loss
from .sizes import FULL, TINY, build_pipeline

TRANSFORMER = Backbone("transformer", "transformer")
# The transformer's block lists, in the order its forward runs them: double-stream, then single.
BLOCK_STACKS = ("transformer_blocks", "single_transformer_blocks")


class FluxFamily(OwnT5Length, HookCaching, ModelFamily):
    name = "flux"
    backbones = (TRANSFORMER,)
    hook_block_stacks = BLOCK_STACKS
    tokenizer_folders = ("tokenizer", "tokenizer_2")
    t5_tokenizer, t5_tokens = "tokenizer_2", T5_TOKENS
    components = ("text_encoder", "text_encoder_2", "transformer", "vae")
    # As diffusers runs Flux.1: its activations overflow fp16.
    gpu_dtype = torch.bfloat16
    default_scheduler = "flow_euler"
    size_reason = "the model's VAE scale factor times its 2x2 latent patches"
    sizes = {"tiny": TINY, "full": FULL}
    level_table = LEVELS
    scene_app = TrainFluxSceneApp

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

    # --- export and engines --------------------------------------------------------------------

    def graph_specs(self, pipe, batch: int, geometry, latent: int, dtype, vae_dtype, cache=None) -> list:
        from ...graphs.specs import GraphSpec
        from ...quantize.quantizers import unsupported_quantizers

        transformer = pipe.transformer.to(dtype)
        config = transformer.config
        tokens, text = (latent // 2) ** 2, self.t5_length(pipe)
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
        from ...runtime.stages import TorchStage

        stages = {"clip": TorchStage(ClipGraph(pipe.text_encoder, penultimate=False, hidden=False, pooled=True),
                                     CLIP, dtype),
                  "t5": TorchStage(T5Graph(pipe.text_encoder_2), T5, dtype),
                  "transformer": self.backbone_stage(pipe.transformer, dtype),
                  "vae": TorchStage(VaeDecoderGraph(pipe.vae), VAE, next(pipe.vae.parameters()).dtype)}
        if cache is not None:
            stages.update(self.cache_stages(self.backbone_modules(pipe), dtype, cache))
        return stages

    def backbone_stage(self, backbone, dtype):
        from ...runtime.stages import TorchStage

        return TorchStage(TransformerGraph(backbone), transformer_network(backbone.config.guidance_embeds), dtype)

    def use_family_forms(self, backbone) -> None:
        from ...runtime.step_modulations import use_step_modulations

        if not use_rotary_halves(backbone):
            print("note: the transformer's q and k stay in diffusers' order (use_rotary_halves): an attention layer "
                  "runs another processor, a projection is fake-quantized, or they are in halves order already")
        use_step_modulations(backbone, adaln_norms())

    def generation_stages(self, pipe) -> dict:
        from ...runtime.step_modulations import modulations_stages

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

    def _native_size(self, model, configs: dict, vae_scale: int) -> tuple[int, int]:
        """The VAE's sample size a side: 1024 for Flux.1, which diffusers' FluxPipeline hard-codes as
        its default (128 latent pixels), and the small size a tiny or scene model was made at."""
        side = configs["vae_config"]["sample_size"]
        return side, side

    def size_multiple(self, vae_scale: int, backbone_config: dict | None = None) -> int:
        # The pipeline packs the latent's 2x2 pixels into one token (the transformer's own
        # patch_size is 1).
        return vae_scale * 2


    # --- its architectures (sizes.py) and scene model (scene.py) -------------------------------

    build_pipeline = staticmethod(build_pipeline)
    scene_loss = staticmethod(scene_loss)


FLUX = FluxFamily()
