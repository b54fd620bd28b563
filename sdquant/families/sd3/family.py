"""SD3.5 as a model family: what the stages ask of it (graphs, export sizes, engine profiles, torch
stages and forms, data flow), over its package's graphs, flow, levels and sizes."""

from __future__ import annotations

import types

import torch

from ..base import Backbone, ModelFamily, vae_scale_factor
from ..encoders import ClipGraph, T5Graph, VaeDecoderGraph
from ...graphs.networks import TOKENS, VAE, Network
from ..dit import OwnT5Length, adaln_norms
from .flow import T5_TOKENS, SD3TextToImage, sd3_axis_sizes
from .graphs import (CLIP_G, CLIP_L, MODULATIONS_NETWORK, NETWORKS, T5, TRANSFORMER, ModulationsGraph,
                     SD3TorchAttnProcessor, TransformerGraph)
from .recipe import LEVELS
from .sizes import FULL, TINY, build_pipeline


class SD3Family(OwnT5Length, ModelFamily):
    name = "sd3"
    backbones = (Backbone("transformer", "transformer"),)
    tokenizer_folders = ("tokenizer", "tokenizer_2", "tokenizer_3")
    t5_tokenizer, t5_tokens = "tokenizer_3", T5_TOKENS
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

    # --- export and engines --------------------------------------------------------------------

    def graph_specs(self, pipe, batch: int, geometry, latent: int, dtype, vae_dtype, cache=None) -> list:
        from ...graphs.specs import GraphSpec
        from ...quantize.quantizers import unsupported_quantizers

        transformer = pipe.transformer.to(dtype)
        config = transformer.config
        text = self.t5_length(pipe)
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
        from ...runtime.stages import TorchStage

        return {"clip_l": TorchStage(ClipGraph(pipe.text_encoder, penultimate=True, pooled=True), CLIP_L, dtype),
                "clip_g": TorchStage(ClipGraph(pipe.text_encoder_2, penultimate=True, pooled=True), CLIP_G, dtype),
                "t5": TorchStage(T5Graph(pipe.text_encoder_3), T5, dtype),
                "transformer": self.backbone_stage(pipe.transformer, dtype),
                "vae": TorchStage(VaeDecoderGraph(pipe.vae), VAE, next(pipe.vae.parameters()).dtype)}

    def backbone_stage(self, backbone, dtype):
        from ...runtime.stages import TorchStage

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
        from ...runtime.step_modulations import use_step_modulations

        use_step_modulations(backbone, adaln_norms())

    def generation_stages(self, pipe) -> dict:
        from ...runtime.step_modulations import modulations_stages

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


    # --- its architectures (sizes.py) ----------------------------------------------------------

    build_pipeline = staticmethod(build_pipeline)


SD3 = SD3Family()
