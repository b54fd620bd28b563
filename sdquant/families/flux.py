"""The Flux family (Flux.1-dev, Flux.1-schnell and the tiny and scene models of their architecture):
graphs clip (pooled embedding), t5 (hidden states), transformer and vae; the DiT's quant levels,
which only Linear layers make up; the data flow of sdquant.flux_pipeline; a tiny model.

The transformer's graph takes diffusers' own inputs: hidden_states (B, L, 64) packed latents,
encoder_hidden_states (B, T, 4096), pooled_projections (B, 768), timestep (B,) in 0..1, img_ids
(L, 3), txt_ids (T, 3) and, for models with the guidance embedding (dev), guidance (B,); it gives
the velocity `latent` (B, L, 64). L, the image's packed tokens, and T, T5's tokens, are dynamic,
as is the batch.
"""

from __future__ import annotations

import contextlib
import types

import torch

from ..networks import BATCH, IMAGE_TOKENS, TEXT_TOKENS, TOKENS, VAE, Network
from ..recipe import LayerGroup, LevelTable
from .base import ModelFamily, vae_scale_factor

# The DiT's levels (every layer is a Linear, so there is no level 1): 2 the feed-forward layers of
# both streams and the single blocks' MLP input projection; 2.5 + the q/k/v projections of both
# streams; 3 + the rest of every block (attention outputs, the single blocks' joint output); 4 = 3
# + FP8 attention. High precision: the embedders of the image, text, timestep and guidance, every
# AdaLN modulation (norm*.linear: its output scales and shifts every activation of its block, and
# it is a batch-row GEMM with nothing to gain), and the final norm_out/proj_out.
LEVELS = LevelTable(
    levels=(2.0, 2.5, 3.0, 4.0),
    groups=(LayerGroup(2.0, "*.ff.net.*", "nn.Linear"), LayerGroup(2.0, "*.ff_context.net.*", "nn.Linear"),
            LayerGroup(2.0, "*.proj_mlp.", "nn.Linear"),
            LayerGroup(2.5, "*.attn.to_[qkv].", "nn.Linear"), LayerGroup(2.5, "*.attn.add_[qkv]_proj.", "nn.Linear"),
            LayerGroup(3.0, "*", "nn.Linear")),
    high_precision=("x_embedder.*", "context_embedder.*", "time_text_embed.*", "*norm*", "proj_out.*",
                    "pos_embed.*"),
)


def transformer_network(guidance: bool) -> Network:
    inputs = {"hidden_states": {0: BATCH, 1: IMAGE_TOKENS}, "encoder_hidden_states": {0: BATCH, 1: TEXT_TOKENS},
              "pooled_projections": {0: BATCH}, "timestep": {0: BATCH}, "img_ids": {0: IMAGE_TOKENS},
              "txt_ids": {0: TEXT_TOKENS}}
    if guidance:
        inputs["guidance"] = {0: BATCH}
    # A transformer without the guidance embedding (Flux.1-schnell's, the scene model's) is exported
    # without that input.
    return Network("transformer", inputs, {"latent": {0: BATCH, 1: IMAGE_TOKENS}}, optional=("guidance",))


CLIP = Network("clip", {"input_ids": {0: BATCH}}, {"pooled": {0: BATCH}})
T5 = Network("t5", {"input_ids": {0: BATCH, 1: TEXT_TOKENS}}, {"hidden_states": {0: BATCH, 1: TEXT_TOKENS}})


class ClipPooledGraph(torch.nn.Module):
    """input_ids -> CLIP's pooled output, the only part of CLIP that Flux reads."""

    def __init__(self, encoder):
        super().__init__()
        # As sdquant.export.TextEncoderGraph: eager attention keeps an fp16 graph in one type.
        encoder.set_attn_implementation("eager")
        self.encoder = encoder

    def forward(self, input_ids):
        return self.encoder(input_ids).pooler_output


class T5Graph(torch.nn.Module):
    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids):
        return self.encoder(input_ids).last_hidden_state


def _rotated(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], sequence_dim: int = 2,
             **_) -> torch.Tensor:
    """Flux's rotary embedding of q or k (pairs of neighbouring features rotated by the position's
    angles), with the pairs split by unflatten: diffusers' reshape to x.shape[:-1] records the
    traced sequence length as a constant, which would pin the graph to one image size."""
    cos, sin = cos_sin
    index = (None, slice(None), None, slice(None)) if sequence_dim == 1 else (None, None, slice(None), slice(None))
    cos, sin = cos[index].to(x.device), sin[index].to(x.device)
    real, imag = x.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(-2)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


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


class FluxFamily(ModelFamily):
    name = "flux"
    backbone = "transformer"
    backbone_graph = "transformer"
    cache_methods = ("none", "first_block", "taylorseer", "taylorseer_blocks")
    tokenizer_folders = ("tokenizer", "tokenizer_2")
    components = ("text_encoder", "text_encoder_2", "transformer", "vae")
    # As diffusers runs Flux.1: its activations overflow fp16.
    gpu_dtype = torch.bfloat16

    def pipeline_class(self):
        from diffusers import FluxPipeline

        return FluxPipeline

    def backbone_class(self):
        from diffusers import FluxTransformer2DModel

        return FluxTransformer2DModel

    def networks(self) -> list[Network]:
        return [CLIP, T5, transformer_network(guidance=True), VAE]

    def quant_levels(self) -> tuple[float, ...]:
        return LEVELS.levels

    def quant_cfg_entries(self, fmt, quant_level: float) -> list[dict]:
        from ..recipe import quant_cfg_entries

        return quant_cfg_entries(LEVELS, fmt, quant_level)

    def scheduler_timestep(self, args: tuple, kwargs: dict):
        # FluxPipeline hands the transformer t / 1000.
        return kwargs["timestep"] * 1000

    def cache_stages(self, backbone, dtype, cache) -> dict:
        from ..transformer_cache import HookedStage

        return {self.backbone_graph: HookedStage(self.backbone_stage(backbone, dtype), backbone, cache)}

    def release_cache(self, backbone) -> None:
        if backbone.is_cache_enabled:
            backbone.disable_cache()

    def text_tokens(self, pipe) -> int:
        from ..flux_pipeline import text_tokens

        return text_tokens(pipe.tokenizer_2)

    def pipeline_call_kwargs(self, pipe) -> dict:
        return {"max_sequence_length": self.text_tokens(pipe)}

    def graph_specs(self, pipe, batch: int, latent: int, dtype, vae_dtype) -> list:
        from ..export import GraphSpec, VaeDecoderGraph
        from ..quantizers import unsupported_quantizers

        transformer = pipe.transformer.to(dtype)
        config = transformer.config
        tokens, text = (latent // 2) ** 2, self.text_tokens(pipe)
        args = [torch.randn(batch, tokens, config.in_channels, dtype=dtype),
                torch.randn(batch, text, config.joint_attention_dim, dtype=dtype),
                torch.randn(batch, config.pooled_projection_dim, dtype=dtype), torch.full((batch,), 0.5, dtype=dtype),
                torch.zeros(tokens, 3), torch.zeros(text, 3)]
        if config.guidance_embeds:
            args.append(torch.full((batch,), 3.5))
        vae = pipe.vae.to(vae_dtype)
        return [
            GraphSpec(CLIP, ClipPooledGraph(pipe.text_encoder.to(dtype)),
                      (torch.zeros(batch, TOKENS, dtype=torch.int32),)),
            GraphSpec(T5, T5Graph(pipe.text_encoder_2.to(dtype)), (torch.zeros(batch, text, dtype=torch.int32),)),
            GraphSpec(VAE, VaeDecoderGraph(vae), (torch.randn(batch, vae.config.latent_channels, latent, latent,
                                                              dtype=vae_dtype),)),
            GraphSpec(transformer_network(config.guidance_embeds), TransformerGraph(transformer), tuple(args),
                      on_meta=not unsupported_quantizers(transformer)),
        ]

    def torch_stages(self, pipe, dtype) -> dict:
        from ..export import VaeDecoderGraph
        from ..stages import TorchStage

        return {"clip": TorchStage(ClipPooledGraph(pipe.text_encoder), CLIP, dtype),
                "t5": TorchStage(T5Graph(pipe.text_encoder_2), T5, dtype),
                "transformer": self.backbone_stage(pipe.transformer, dtype),
                "vae": TorchStage(VaeDecoderGraph(pipe.vae), VAE, next(pipe.vae.parameters()).dtype)}

    def backbone_stage(self, backbone, dtype):
        from ..stages import TorchStage

        return TorchStage(TransformerGraph(backbone), transformer_network(backbone.config.guidance_embeds), dtype)

    def text_to_image(self, stages: dict, parts: dict, scheduler, device):
        from ..flux_pipeline import FluxTextToImage

        return FluxTextToImage(stages, parts["tokenizers"], scheduler, types.SimpleNamespace(**parts["backbone_config"]),
                               vae_scale_factor(parts["vae_config"]), device)

    def default_scheduler(self) -> str:
        return "flow_euler"

    def native_image_size(self, configs: dict, vae_scale: int) -> int:
        """The VAE's sample size: 1024 for Flux.1, which diffusers' FluxPipeline hard-codes as its
        default (128 latent pixels), and the small size a tiny or scene model was made at."""
        return configs["vae_config"]["sample_size"]

    size_reason = "the model's VAE scale factor times its 2x2 latent patches"

    def size_multiple(self, vae_scale: int) -> int:
        return vae_scale * 2

    def build_tiny(self, folder) -> None:
        from ..synthetic import build_tiny_flux

        build_tiny_flux().save_pretrained(folder)

    def carries_adapters(self, graph: str) -> bool:
        """diffusers' Flux LoRA loader writes into the transformer and CLIP, never into T5."""
        return graph in ("transformer", "clip")


FLUX = FluxFamily()
