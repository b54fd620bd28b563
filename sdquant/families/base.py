"""What every model family describes; one subclass per family in its own module."""

from __future__ import annotations

import torch

from ..networks import Network


class ModelFamily:
    """What the stages need to know of one family of diffusers pipelines. Subclasses set the
    attributes and implement the methods; nothing else in sdquant knows a family by name."""

    name: str
    # The pipeline's denoising network: its attribute on the pipeline (and folder), and its graph.
    backbone: str
    backbone_graph: str
    # The names of this family's tokenizers in a diffusers folder, in the order the pipeline uses.
    tokenizer_folders: tuple[str, ...]
    # The pipeline components its graphs are made from (a folder without one is another family's).
    components: tuple[str, ...]
    # What it runs in on a GPU.
    gpu_dtype = torch.float16
    # The pipeline's tokenizers that cut prompts to CLIP's 77-token window.
    clip_tokenizers: tuple[str, ...] = ("tokenizer",)

    def pipeline_class(self):
        raise NotImplementedError

    def backbone_class(self):
        raise NotImplementedError

    def networks(self) -> list[Network]:
        """The pipeline's networks in export order, text encoders first, the backbone last."""
        raise NotImplementedError

    def quant_levels(self) -> tuple[float, ...]:
        raise NotImplementedError

    def quant_cfg_entries(self, fmt, quant_level: float) -> list[dict]:
        """ModelOpt's quant_cfg for this format and level: everything off, what each level adds,
        then what stays in high precision last, so no level can turn it back on."""
        raise NotImplementedError

    def recipe_revisions(self, fmt, quant_level: float) -> dict:
        """What the recipe calibrates differently from older sdquant at this format and level, for
        the fingerprint of the checkpoints it changes (sdquant.recipe.revisions)."""
        raise NotImplementedError

    def scheduler_timestep(self, args: tuple, kwargs: dict):
        """The timestep a call of the backbone (by the diffusers pipeline) is made with, on the
        scheduler's own scale, so the calibration's step clock can find it in the schedule."""
        raise NotImplementedError

    def graph_specs(self, pipe, batch: int, latent: int, dtype, vae_dtype) -> list:
        """What to trace for each graph (sdquant.export.GraphSpec), the backbone last."""
        raise NotImplementedError

    def torch_stages(self, pipe, dtype) -> dict:
        """The pipeline's modules as stages (sdquant.stages.TorchStage), by graph name."""
        raise NotImplementedError

    def backbone_stage(self, backbone, dtype):
        raise NotImplementedError

    def text_to_image(self, stages: dict, parts: dict, scheduler, device):
        """The family's text-to-image data flow over `stages` (parts: tokenizers and configs)."""
        raise NotImplementedError

    def default_scheduler(self) -> str:
        """The sampling.scheduler the family runs when none is asked for."""
        raise NotImplementedError

    # sampling.cache.method values the family's backbone takes.
    cache_methods: tuple[str, ...] = ("none",)

    def cache_stages(self, backbone, dtype, cache) -> dict:
        """The backbone's stages under a step cache (sampling.cache), by graph name."""
        raise NotImplementedError

    def release_cache(self, backbone) -> None:
        """Takes a step cache's changes off the backbone module, so that it runs uncached again."""

    def cache_networks(self) -> list[Network]:
        """The graphs a step cache runs besides the pipeline's (DeepCache: the UNet's two passes)."""
        return []

    def cache_graph_specs(self, pipe, batch: int, latent: int, dtype, cache) -> list:
        """What to trace for each of cache_networks()."""
        raise NotImplementedError

    def backbone_graphs(self) -> tuple[str, ...]:
        """The graphs that run the backbone: its own and those of its cached passes."""
        return (self.backbone_graph, *(network.name for network in self.cache_networks()))

    def text_tokens(self, pipe) -> int | None:
        """The length of the pipeline's T5 sequence, for a family that has one."""
        return None

    def pipeline_call_kwargs(self, pipe) -> dict:
        """What a call of the diffusers pipeline needs besides prompts, steps, guidance and size,
        so that calibration and training's check see the inputs the graphs will."""
        return {}

    def native_image_size(self, configs: dict, vae_scale: int) -> int:
        """The side the model was trained at, as diffusers' pipelines default to it: the backbone's
        sample size in latent pixels times the VAE's scale factor (1024 for SDXL, 512 for SD 1.5)."""
        return configs["backbone_config"]["sample_size"] * vae_scale

    # What size_multiple is, in words.
    size_reason = "the model's VAE scale factor"

    def size_multiple(self, vae_scale: int) -> int:
        """What image sides must be a multiple of: the VAE's scale, times a DiT's patch size."""
        return vae_scale

    def build_tiny(self, folder) -> None:
        """Builds the family's tiny random-weight pipeline into `folder` (save_pretrained)."""
        raise NotImplementedError

    def carries_adapters(self, graph: str) -> bool:
        """Whether an exported graph holds LoRA weights (diffusers loads them into the backbone and
        the text encoders it names, never into the VAE)."""
        return graph != "vae"

    def guided_graphs(self) -> tuple[str, ...]:
        """Graphs that see two samples per image under classifier-free guidance."""
        return ()

    def engine_keys(self) -> dict[str, str]:
        """The inference config key naming each graph's engine (NeMo's keys for SDXL)."""
        return {network.name: network.name for network in self.networks()}

    def network(self, name: str) -> Network:
        return {each.name: each for each in (*self.networks(), *self.cache_networks())}[name]

    def graph_names(self) -> tuple[str, ...]:
        return tuple(network.name for network in self.networks())


def vae_scale_factor(vae_config) -> int:
    """Image pixels per latent pixel along each side, as diffusers' pipelines compute it: 8 for SD
    and SDXL, 4 for the scene model's three-level VAE."""
    return 2 ** (len(vae_config["block_out_channels"]) - 1)
