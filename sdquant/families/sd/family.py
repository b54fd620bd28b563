"""SD 1.5 / 2.x and SDXL as model families: what the stages ask of them (graphs, DeepCache's passes,
engine profiles, torch stages, data flow), over the package's graphs, flows, levels, sizes and
scene model. SDXL extends SD with a second CLIP encoder and the UNet's text-time add-embeddings."""

from __future__ import annotations

import dataclasses
import types

import torch

from ..base import Backbone, ModelFamily, vae_scale_factor
from .deep_cache import DeepCache, FullPass, ShallowPass, deep_sizes, passes
from ..encoders import ClipGraph, VaeDecoderGraph, clip_network
from .flow import SDTextToImage, SDXLTextToImage
from .graphs import UNetFp8AttnProcessor, UNetGraph, unet_axis_sizes, unet_network
from ...graphs.networks import TOKENS, VAE, Network
from .recipe import LEVELS
from .scene import TrainSdxlSceneApp, scene_loss
from .sizes import SD_TINY, SDXL_FULL, SDXL_TINY, build_sd_pipeline, build_sdxl_pipeline


class StableDiffusionFamily(ModelFamily):
    """SD 1.5 and 2.x: one CLIP text encoder, a UNet without add-embeddings, an AutoencoderKL."""

    name = "sd"
    backbones = (Backbone("unet", "unet"),)
    tokenizer_folders = ("tokenizer",)
    clip_tokenizers = ("tokenizer",)
    components = ("text_encoder", "unet", "vae")
    cache_methods = ("none", "deepcache")
    default_scheduler = "euler"
    sizes = {"tiny": SD_TINY}
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
        from ...graphs.specs import GraphSpec

        return [GraphSpec(self.text_networks()[0], ClipGraph(pipe.text_encoder.to(dtype), penultimate=False), (ids,))]

    def unet_args(self, unet, batch: int, latent: int, dtype) -> tuple:
        args = [torch.randn(batch, 4, latent, latent, dtype=dtype), torch.full((batch,), 500.0),
                torch.randn(batch, TOKENS, unet.config.cross_attention_dim, dtype=dtype)]
        if self.pooled_input:
            args.append(torch.randn(batch, unet.config.projection_class_embeddings_input_dim, dtype=dtype))
        return tuple(args)

    def graph_specs(self, pipe, batch: int, geometry, latent: int, dtype, vae_dtype, cache=None) -> list:
        from ...graphs.specs import GraphSpec
        from ...quantize.quantizers import unsupported_quantizers

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
        from ...runtime.stages import TorchStage

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
        from ...runtime.stages import TorchStage

        return TorchStage(UNetGraph(backbone), self.unet(), dtype)

    def cache_stages(self, modules: dict, dtype, cache) -> dict:
        from ...runtime.stages import TorchStage

        backbone = modules[self.backbones[0].attribute]
        full, shallow = self.cached_passes()
        return {full.name: TorchStage(FullPass(backbone, cache.branch), full, dtype),
                shallow.name: TorchStage(ShallowPass(backbone, cache.branch), shallow, dtype)}

    def text_to_image(self, stages: dict, parts: dict, scheduler, device):
        return self.text_to_image_class(stages, parts["tokenizers"], scheduler,
                                        types.SimpleNamespace(**parts["backbone_config"]),
                                        vae_scale_factor(parts["vae_config"]), device, self.unet_graph)

    # --- its architectures (sizes.py) ----------------------------------------------------------

    build_pipeline = staticmethod(build_sd_pipeline)


SD = StableDiffusionFamily()


class SDXLFamily(StableDiffusionFamily):
    """SDXL: two CLIP encoders (the second with projection), a UNet with text-time add-embeddings."""

    name = "sdxl"
    backbones = (Backbone("unet", "unet_xl"),)
    tokenizer_folders = ("tokenizer", "tokenizer_2")
    clip_tokenizers = ("tokenizer", "tokenizer_2")
    components = ("text_encoder", "text_encoder_2", "unet", "vae")
    sizes = {"tiny": SDXL_TINY, "full": SDXL_FULL}
    pooled_input = True
    text_to_image_class = SDXLTextToImage
    scene_app = TrainSdxlSceneApp

    def pipeline_class(self):
        from diffusers import StableDiffusionXLPipeline

        return StableDiffusionXLPipeline

    def text_networks(self) -> list[Network]:
        return [dataclasses.replace(clip_network("clip1"), guided=True),
                dataclasses.replace(clip_network("clip2", pooled=True), guided=True)]

    def text_graphs(self, pipe) -> list[tuple[Network, torch.nn.Module]]:
        first, second = self.text_networks()
        return [(first, ClipGraph(pipe.text_encoder, penultimate=True)),
                (second, ClipGraph(pipe.text_encoder_2, penultimate=True, pooled=True))]

    def text_graph_specs(self, pipe, ids: torch.Tensor, dtype) -> list:
        from ...graphs.specs import GraphSpec

        first, second = self.text_networks()
        return [GraphSpec(first, ClipGraph(pipe.text_encoder.to(dtype), penultimate=True), (ids,)),
                GraphSpec(second, ClipGraph(pipe.text_encoder_2.to(dtype), penultimate=True, pooled=True), (ids,))]

    # --- its architectures (sizes.py) and scene model (scene.py) -------------------------------

    build_pipeline = staticmethod(build_sdxl_pipeline)
    scene_loss = staticmethod(scene_loss)


SDXL = SDXLFamily()
