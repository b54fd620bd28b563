"""The Stable Diffusion family: SDXL (NeMo's graphs clip1, clip2, unet_xl, vae; the UNet takes
x, timesteps, context and y) and SD 1.5 / 2.x (clip1, unet, vae), their UNet's quant levels, the
text-to-image data flow of sdquant.pipeline and the tiny models of sdquant.synthetic."""

from __future__ import annotations

import contextlib
import types

import torch

from ..networks import BATCH, CONTEXT, LATENT, TOKENS, VAE, Network
from ..recipe import LayerGroup, LevelTable
from .base import ModelFamily, vae_scale_factor

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


def text_encoder(name: str, pooled: bool) -> Network:
    """input_ids -> the hidden states the pipeline conditions on (and the pooled embedding)."""
    outputs = {"hidden_states": {0: BATCH}, **({"pooled": {0: BATCH}} if pooled else {})}
    return Network(name, {"input_ids": {0: BATCH}}, outputs)


def unet(sdxl: bool) -> Network:
    """x, timesteps, context and (SDXL) y, NeMo's pooled text embedding joined to the Fourier-embedded
    time ids -> the noise prediction."""
    inputs = {"x": LATENT, "timesteps": {0: BATCH}, "context": {0: BATCH, 1: CONTEXT}}
    if sdxl:
        inputs["y"] = {0: BATCH}
    return Network("unet_xl" if sdxl else "unet", inputs, {"out": LATENT})


def sdxl_y(unet, pooled: torch.Tensor, time_ids: torch.Tensor) -> torch.Tensor:
    """NeMo's ``y``: the pooled text embedding joined to the Fourier-embedded time ids."""
    fourier = unet.add_time_proj(time_ids.flatten()).reshape(pooled.shape[0], -1)
    return torch.cat([pooled, fourier.to(pooled.dtype)], dim=-1)


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


class UNetGraph(torch.nn.Module):
    # The Fourier time embedding builds its frequencies with arange on the timesteps' device: on
    # the meta device they would have no values, so for a meta trace the timesteps stay on the CPU
    # and only their embedding moves to meta.
    host_inputs = ("timesteps",)

    def __init__(self, unet, sdxl: bool):
        super().__init__()
        self.unet = unet
        self.sdxl = sdxl

    def host_modules(self) -> list[torch.nn.Module]:
        return [self.unet.time_proj]

    def forward(self, x, timesteps, context, y=None):
        if not self.sdxl:
            return self.unet(x, timesteps, encoder_hidden_states=context, return_dict=False)[0]
        with y_conditioning(self.unet):
            return self.unet(x, timesteps, encoder_hidden_states=context, added_cond_kwargs={"y": y},
                             return_dict=False)[0]


class StableDiffusionFamily(ModelFamily):
    backbone = "unet"
    cache_methods = ("none", "deepcache")

    def __init__(self, sdxl: bool):
        self.sdxl = sdxl
        self.name = "sdxl" if sdxl else "sd"
        self.backbone_graph = unet(sdxl).name
        self.tokenizer_folders = ("tokenizer", "tokenizer_2") if sdxl else ("tokenizer",)
        self.clip_tokenizers = self.tokenizer_folders
        self.components = ("text_encoder", "text_encoder_2", "unet", "vae") if sdxl else ("text_encoder", "unet", "vae")

    def pipeline_class(self):
        from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

        return StableDiffusionXLPipeline if self.sdxl else StableDiffusionPipeline

    def backbone_class(self):
        from diffusers import UNet2DConditionModel

        return UNet2DConditionModel

    def networks(self) -> list[Network]:
        """The pipeline's networks with NeMo's graph names, text encoders first."""
        if self.sdxl:
            return [text_encoder("clip1", pooled=False), text_encoder("clip2", pooled=True), unet(True), VAE]
        return [text_encoder("clip1", pooled=False), unet(False), VAE]

    def quant_levels(self) -> tuple[float, ...]:
        return LEVELS.levels

    def quant_cfg_entries(self, fmt, quant_level: float) -> list[dict]:
        from ..recipe import quant_cfg_entries

        return quant_cfg_entries(LEVELS, fmt, quant_level)

    def recipe_revisions(self, fmt, quant_level: float) -> dict:
        from ..recipe import revisions

        return revisions(LEVELS, fmt, quant_level)

    def scheduler_timestep(self, args: tuple, kwargs: dict):
        return kwargs["timestep"] if "timestep" in kwargs else args[1]

    def graph_specs(self, pipe, batch: int, latent: int, dtype, vae_dtype) -> list:
        from ..export import GraphSpec, TextEncoderGraph, VaeDecoderGraph
        from ..quantizers import unsupported_quantizers

        ids = torch.zeros(batch, TOKENS, dtype=torch.int32)
        specs = [GraphSpec(text_encoder("clip1", pooled=False),
                           TextEncoderGraph(pipe.text_encoder.to(dtype), penultimate=self.sdxl, pooled=False), (ids,))]
        if self.sdxl:
            specs.append(GraphSpec(text_encoder("clip2", pooled=True),
                                   TextEncoderGraph(pipe.text_encoder_2.to(dtype), penultimate=True, pooled=True),
                                   (ids,)))
        vae = pipe.vae.to(vae_dtype)
        specs.append(GraphSpec(VAE, VaeDecoderGraph(vae), (torch.randn(batch, 4, latent, latent, dtype=vae_dtype),)))
        specs.append(GraphSpec(unet(self.sdxl), UNetGraph(pipe.unet.to(dtype), self.sdxl),
                               self._unet_args(pipe.unet, batch, latent, dtype),
                               on_meta=not unsupported_quantizers(pipe.unet)))
        return specs

    def _unet_args(self, unet_module, batch: int, latent: int, dtype) -> tuple:
        args = [torch.randn(batch, 4, latent, latent, dtype=dtype), torch.full((batch,), 500.0),
                torch.randn(batch, TOKENS, unet_module.config.cross_attention_dim, dtype=dtype)]
        if self.sdxl:
            args.append(torch.randn(batch, unet_module.config.projection_class_embeddings_input_dim, dtype=dtype))
        return tuple(args)

    def torch_stages(self, pipe, dtype) -> dict:
        from ..export import TextEncoderGraph, VaeDecoderGraph
        from ..stages import TorchStage

        stages = {"clip1": TorchStage(TextEncoderGraph(pipe.text_encoder, penultimate=self.sdxl, pooled=False),
                                      text_encoder("clip1", pooled=False), dtype),
                  "vae": TorchStage(VaeDecoderGraph(pipe.vae), VAE, next(pipe.vae.parameters()).dtype)}
        if self.sdxl:
            stages["clip2"] = TorchStage(TextEncoderGraph(pipe.text_encoder_2, penultimate=True, pooled=True),
                                         text_encoder("clip2", pooled=True), dtype)
        stages[self.backbone_graph] = self.backbone_stage(pipe.unet, dtype)
        return stages

    def backbone_stage(self, backbone, dtype):
        from ..stages import TorchStage

        return TorchStage(UNetGraph(backbone, self.sdxl), unet(self.sdxl), dtype)

    def cache_stages(self, backbone, dtype, cache) -> dict:
        from ..deep_cache import FullPass, ShallowPass, passes
        from ..stages import TorchStage

        full, shallow = passes(unet(self.sdxl))
        return {full.name: TorchStage(FullPass(backbone, cache.branch), full, dtype),
                shallow.name: TorchStage(ShallowPass(backbone, cache.branch), shallow, dtype)}

    def cache_networks(self) -> list[Network]:
        from ..deep_cache import passes

        return list(passes(unet(self.sdxl)))

    def cache_graph_specs(self, pipe, batch: int, latent: int, dtype, cache) -> list:
        from ..deep_cache import DEEP_HEIGHT, DEEP_WIDTH, FullPass, ShallowPass, deep_sizes
        from ..export import GraphSpec
        from ..quantizers import unsupported_quantizers

        module = pipe.unet.to(dtype)
        args = self._unet_args(module, batch, latent, dtype)
        full, shallow = self.cache_networks()
        sizes = deep_sizes(latent, latent, cache.branch)
        deep = torch.randn(batch, module.config.block_out_channels[cache.branch + 1], sizes[DEEP_HEIGHT],
                           sizes[DEEP_WIDTH], dtype=dtype)
        on_meta = not unsupported_quantizers(module)
        return [GraphSpec(full, FullPass(module, cache.branch), args, on_meta=on_meta),
                GraphSpec(shallow, ShallowPass(module, cache.branch), (*args, deep), on_meta=on_meta)]

    def text_to_image(self, stages: dict, parts: dict, scheduler, device):
        from ..pipeline import TextToImage

        return TextToImage(stages, parts["tokenizers"], scheduler, types.SimpleNamespace(**parts["backbone_config"]),
                           vae_scale_factor(parts["vae_config"]), device, self.sdxl)

    def default_scheduler(self) -> str:
        return "euler"

    def build_tiny(self, folder) -> None:
        from ..synthetic import TINY, build_pipeline

        build_pipeline("sdxl" if self.sdxl else "sd15", TINY).save_pretrained(folder)

    def guided_graphs(self) -> tuple[str, ...]:
        return tuple(name for name in (*self.graph_names(), *self.backbone_graphs()[1:]) if name != "vae")

    def engine_keys(self) -> dict[str, str]:
        """NeMo's keys: unet_xl names the UNet engine for SD 1.5 too."""
        return {"clip1": "clip1", "clip2": "clip2", "unet_xl": "unet_xl", "unet": "unet_xl", "vae": "vae"}


SDXL = StableDiffusionFamily(sdxl=True)
SD = StableDiffusionFamily(sdxl=False)
