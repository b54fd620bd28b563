"""What every model family describes, in one small base; one subclass per family in its own package."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import UserError
from ..graphs.geometry import SampleGeometry
from ..graphs.networks import Network
from ..quantize.shared_ranges import AttentionProjections

if TYPE_CHECKING:
    from ..quantize.recipe import LevelTable


@dataclass(frozen=True)
class Backbone:
    """A denoising network of the pipeline, which the 8 bits go into: its attribute on the pipeline
    (and folder of the model) and the name of its graph and engine."""

    attribute: str
    graph: str


@dataclass(frozen=True)
class Sample:
    """What one pipeline call draws, settled by its family: the geometry, the frame rate (a video's),
    and the guidance of the first and the second expert (None: the first's)."""

    geometry: SampleGeometry
    fps: int | None
    guidance_scale: float
    guidance_scale_2: float | None


# Every random-weight model is built from this seed, so the same sizes give the same weights.
SEED = 1234

# diffusers' attention modules' projections that read one input, and the name it gives their fused
# layer: a self-attention's q, k and v, a cross-attention's k and v, a joint attention's text stream's.
QKV = (("to_q", "to_k", "to_v"), "to_qkv")
KV = (("to_k", "to_v"), "to_kv")
ADDED_QKV = (("add_q_proj", "add_k_proj", "add_v_proj"), "to_added_qkv")


class ModelFamily:
    """What the stages need to know of one family of diffusers pipelines. Subclasses set the
    attributes and implement the methods; nothing outside sdquant.families knows a family by name."""

    name: str
    # The pipeline's denoising networks (most families have one; a two-expert video model two).
    backbones: tuple[Backbone, ...]
    # The names of this family's tokenizers in a diffusers folder, in the order the pipeline uses.
    tokenizer_folders: tuple[str, ...]
    # The pipeline components its graphs are made from (a folder without one is another family's).
    components: tuple[str, ...]
    # What it runs in on a GPU.
    gpu_dtype = torch.float16
    # The pipeline's tokenizers that cut prompts to CLIP's 77-token window.
    clip_tokenizers: tuple[str, ...] = ("tokenizer",)
    # sampling.cache.method values its backbone takes.
    cache_methods: tuple[str, ...] = ("none",)
    # The sampling.scheduler it runs when none is asked for.
    default_scheduler: str
    # What size_multiple is, in words.
    size_reason = "the model's VAE scale factor"
    # Named architectures build_pipeline takes: "tiny" (toy widths, for tests on a CPU) and "full"
    # (the real model's layer sizes, random weights, for speed and memory benchmarks).
    sizes: dict[str, object] = {}
    # Its quantization levels: which layer groups each adds, what stays in high precision
    # (sdquant.quantize.recipe.LevelTable).
    level_table: LevelTable
    # What its pipeline draws, which decides how samples are written and scored: image or video.
    output = "image"
    # Whether its backbones' and VAE's convolutions take the channels-last layout the compiled torch
    # backend gives them (2-D ones do; a video family's 3-D ones have no such layout).
    channels_last = True
    # Whether the torch backend compiles its decoder (torch_backend.compile) and replays it as CUDA
    # graphs (cuda_graph), as it does its backbones (an image VAE's decode runs faster so).
    compiles_decoder = True
    # What its attention layers call the projections that read one input or one attention output
    # (diffusers' names): the layers that share an FP8 range and run as one kernel.
    attention_projections = AttentionProjections(QKV, KV, ADDED_QKV, output="to_out.0", added_output="to_add_out")
    # Its scene model's training schema (a config.SceneTrainingApp: its tools/train_scene_model.py
    # config_name, its encoders' tokenizers, its architecture's sizes and checks); None: the family
    # has no scene model.
    scene_app: type | None = None

    @property
    def backbone_attributes(self) -> tuple[str, ...]:
        """Each backbone's attribute on the pipeline: its folder in a diffusers model and its file in a
        checkpoint."""
        return tuple(backbone.attribute for backbone in self.backbones)

    @property
    def configs_backbone(self) -> Backbone:
        """The backbone whose config the stages read for the latents' shape (channels, sample size,
        patches): every backbone of a family denoises the same latents."""
        return self.backbones[0]

    def backbone_modules(self, pipe) -> dict:
        """The pipeline's backbone modules, by attribute."""
        return {backbone.attribute: getattr(pipe, backbone.attribute) for backbone in self.backbones}

    def pipeline_class(self):
        raise NotImplementedError

    def backbone_class(self):
        raise NotImplementedError

    # --- its networks -------------------------------------------------------------------------

    def networks(self, cache=None) -> list[Network]:
        """The pipeline's networks in export order, text encoders first, the backbone last, and the
        backbone's cached passes where `cache` runs its own graphs."""
        raise NotImplementedError

    def network(self, name: str) -> Network:
        """Any of its graphs by name, cached passes included."""
        return {network.name: network for network in self.networks()}[name]

    def graph_names(self) -> tuple[str, ...]:
        return tuple(network.name for network in self.networks())

    def backbone_graphs(self) -> tuple[str, ...]:
        """The graphs that run a backbone: each backbone's own and those of its cached passes."""
        return (*(backbone.graph for backbone in self.backbones), *self.cached_graphs())

    def cached_graphs(self) -> tuple[str, ...]:
        """The graphs of a step cache's passes of a backbone (DeepCache's full and shallow UNet),
        exported beside the backbone's own where the engines are for that cache."""
        return ()

    def carries_adapters(self, graph: str) -> bool:
        """Whether an exported graph holds LoRA weights (diffusers loads them into the backbone and
        the text encoders it names, never into the VAE)."""
        return graph != "vae"

    # --- quantization --------------------------------------------------------------------------

    def quant_cfg_entries(self, fmt, quant_level: float, high_precision_blocks=None) -> list[dict]:
        """ModelOpt's quant_cfg for this format and level: everything off, what each level adds,
        then what stays in high precision last, so no level can turn it back on;
        `high_precision_blocks`: quantize.high_precision_blocks (None: the recipe's)."""
        # Imported here: sdquant.config imports the families, and the recipe imports the config.
        from ..quantize.recipe import quant_cfg_entries

        return quant_cfg_entries(self.level_table, fmt, quant_level, high_precision_blocks)

    def scheduler_timestep(self, args: tuple, kwargs: dict):
        """The timestep a call of the backbone (by the diffusers pipeline) is made with, on the
        scheduler's own scale, so the calibration's step clock can find it in the schedule."""
        raise NotImplementedError

    def pipeline_call_kwargs(self, pipe) -> dict:
        """What a call of the diffusers pipeline needs besides prompts, steps, guidance and size,
        so that calibration and training's check see the inputs the graphs will."""
        return {}

    def calibration_call_kwargs(self, block) -> dict:
        """What calibration's call of the diffusers pipeline takes from the settled quantize block
        besides prompts, steps, guidance and size (a video's frames)."""
        return {}

    # --- the sample's geometry and guidance -----------------------------------------------------

    def _settled_frames(self, asked: int | None, key: str, model) -> int:
        """The frames of a sample, from config `key` (null: the model's own); an image model draws
        one and refuses any other count."""
        if asked not in (None, 1):
            raise UserError(f"{key}={asked}: model={model.name} draws images: leave {key} unset (or 1)")
        return 1

    def _settled_fps(self, asked: int | None, key: str, model) -> int | None:
        """The frames per second a written video plays at; an image model has none."""
        if asked is not None:
            raise UserError(f"{key}={asked}: model={model.name} draws images, which have no frame rate: leave it unset")
        return None

    def settle_sample(self, model, configs: dict, prefix: str, height: int | None, width: int | None,
                      num_frames: int | None, fps: int | None, guidance_scale: float | None,
                      guidance_scale_2: float | None) -> Sample:
        """What one call draws, as the family decides it, every value checked before any work: the
        geometry (a null size or frame count the model's own; a size the family's grid can make), the
        frame rate and the guidance (a null scale the model's). `configs`: the model folder's
        (scheduler, backbone, VAE; none for a single file, whose size must then be given); `prefix`:
        how the caller names the values in messages ("sampling.", "quantize.", "")."""
        from ..config import validate_image_size

        guidance = self.settle_guidance(model, prefix, guidance_scale, guidance_scale_2)
        frames = self._settled_frames(num_frames, f"{prefix}num_frames", model)
        frame_rate = self._settled_fps(fps, f"{prefix}fps", model)
        asked = {"height": height, "width": width}
        if configs:
            scale = self.vae_scale(configs["vae_config"])
            native = dict(zip(("height", "width"), self._native_size(model, configs, scale)))
            multiple = self.size_multiple(scale, configs["backbone_config"])
        elif None in asked.values():
            raise UserError(f"{prefix}height and {prefix}width: model.source={model.source} is a single file, which "
                            "does not state the model's native size: set both (1024 for SDXL, 512 for SD 1.5), or "
                            "set model.single_file_config")
        else:
            native, multiple = asked, 1
        size = {key: native[key] if value is None else value for key, value in asked.items()}
        validate_image_size(size, prefix, multiple, self.size_reason)
        return Sample(SampleGeometry(frames, size["height"], size["width"]), frame_rate, *guidance)

    def settle_guidance(self, model, prefix: str, guidance_scale: float | None,
                        guidance_scale_2: float | None) -> tuple[float, float | None]:
        """The guidance of the first and the second expert, each null one the model's own
        (model.guidance_scale, model.guidance_scale_2); a second scale refused for a family of one
        backbone. The second stays null where both are, which the pipelines read as the first's."""
        for key, second in ((f"{prefix}guidance_scale_2", guidance_scale_2), ("model.guidance_scale_2",
                                                                              model.guidance_scale_2)):
            if second is not None and len(self.backbones) == 1:
                raise UserError(f"{key}={second}: {self.name} models have one backbone; the second guidance scale "
                                "is a two-expert model's (Wan2.2-T2V-A14B): leave it unset")
        return (model.guidance_scale if guidance_scale is None else guidance_scale,
                model.guidance_scale_2 if guidance_scale_2 is None else guidance_scale_2)

    def check_declared(self, model, parts: dict) -> None:
        """Refuses, before any work, what a model folder declares that the family's data flow cannot
        run (`parts`: its configs, as sdquant.load reads them): a scheduler of no training steps."""
        train_steps = parts["scheduler_config"].get("num_train_timesteps", 1000)
        if not (isinstance(train_steps, int) and train_steps >= 1):
            raise UserError(f"model.source={model.source}: its scheduler/scheduler_config.json declares "
                            f"num_train_timesteps={train_steps!r}: fix the folder (1000 in every diffusion model here)")

    def backbone_steps(self, parts: dict, steps: int) -> dict[str, int]:
        """The denoising steps of `steps` each backbone serves, by attribute: every one, by default."""
        return {attribute: steps for attribute in self.backbone_attributes}

    # --- export and engines --------------------------------------------------------------------

    def graph_specs(self, pipe, batch: int, geometry, trace_latent: int, dtype, vae_dtype, cache=None) -> list:
        """What to trace for each graph (sdquant.graphs.specs.GraphSpec), the backbones last: graphs
        with dynamic sizes traced at latents `trace_latent` a side, and any whose sizes are fixed at
        the engines' `geometry` (sdquant.graphs.geometry.SampleGeometry)."""
        raise NotImplementedError

    def export_sizes(self, pipe, geometry) -> dict:
        """The sequence lengths the model fixes (a T5 tokenizer's length), which each graph's export
        record keeps for its engine's profile."""
        return {}

    def traced_geometry_record(self, graph: str, geometry) -> dict:
        """What a graph's fingerprint records of the geometry it was traced at: nothing for a graph
        whose sizes stay dynamic."""
        return {}

    def profile_axis_sizes(self, graph: str, geometry, record: dict, trt) -> list[dict[str, int]]:
        """The (min, opt, max) size of every dynamic axis but the batch of `graph`'s engine, for samples
        of `geometry`; `record`: the graph's export record (export_sizes, the VAE's scale, a cached
        pass's settings); `trt`: the build's settings (trt.max_prompt_chunks)."""
        raise NotImplementedError

    # --- running it ----------------------------------------------------------------------------

    def step_cache(self, block):
        """The step cache sampling.cache asks for (None for none); the method is one of cache_methods."""
        return None

    def torch_stages(self, pipe, dtype, cache=None) -> dict:
        """The pipeline's modules as stages (sdquant.runtime.stages.TorchStage), by graph name, with the
        backbone's cached passes (or its hooked stage) under `cache`."""
        raise NotImplementedError

    def backbone_stage(self, backbone, dtype):
        """The backbone module of a family of one as its graph's stage."""
        raise NotImplementedError

    def backbone_stages(self, modules: dict, dtype) -> dict:
        """The backbone modules (by attribute) as their graphs' stages, by graph (evaluate.py's
        quantized variants)."""
        (backbone,) = self.backbones  # a family of several backbones says which graph each runs
        return {backbone.graph: self.backbone_stage(modules[backbone.attribute], dtype)}

    def cache_stages(self, modules: dict, dtype, cache) -> dict:
        """The backbones' stages under a step cache (the modules by attribute), by graph name."""
        raise NotImplementedError

    def release_cache(self, backbone) -> None:
        """Takes a step cache's changes off the backbone module, so that it runs uncached again."""

    def fuse_projections(self, backbone) -> None:
        """Makes the unquantized backbone's projections that read one input one GEMM each, as
        diffusers' fuse_qkv_projections does (the compiled torch backend's recipe)."""
        backbone.fuse_qkv_projections()

    def use_family_forms(self, backbone) -> None:
        """Gives the backbone's layers, in place, forms that compute the same function and compile to
        faster kernels (after its projections are fused or converted; the torch backend calls it when
        it compiles)."""

    def generation_stages(self, pipe) -> dict:
        """Stages the family's data flow runs once a generation, before its loop, for what its
        backbone's forms (use_family_forms) take as inputs instead of computing them at every step
        (Flux's and SD3.5's: the AdaLN modulations of every step), by name; none by default."""
        return {}

    # Samples one backbone call of the torch backend takes at most, the batch run in turn (None: the
    # whole batch in one call, which serves images' short sequences best).
    backbone_call_samples: int | None = None

    def sequence_tokens(self, parts: dict, geometry) -> int | None:
        """The tokens each backbone call attends over where the family's backbones can be split by
        sequence over processes (parallel.ulysses, diffusers' context parallelism); None where not."""
        return None

    def frame_attention_blocks(self, backbone_config: dict) -> int | None:
        """How many blocks a backbone of this config has whose self-attention runs over a video's
        tokens frame after frame (torch_backend.attention_window); None for a family without frames."""
        return None

    def frame_attention_layers(self, backbone) -> dict:
        """Those self-attention layers of `backbone`, by block index."""
        return {}

    def tokens_per_frame(self, backbone, hidden_states: torch.Tensor) -> int:
        """The tokens of one latent frame in `backbone`'s sequence, from the latent it is called on."""
        raise NotImplementedError

    def fp8_attention_processor(self, attn):
        """The attention processor that runs attention layer `attn` of a backbone the torch backend
        converted to FP8 (sdquant.runtime.attention: fused projections, FP8 attention), following
        diffusers' own processor for it; None for a layer it has none for, which then stays as it is."""
        return None

    def text_to_image(self, stages: dict, parts: dict, scheduler, device):
        """The family's text-to-image data flow over `stages` (parts: tokenizers and configs)."""
        raise NotImplementedError

    def parts_of(self, pipe) -> dict:
        """What text_to_image needs of a diffusers pipeline already loaded (sdquant.load.pipeline_parts
        reads the same from a model's folder without its weights)."""
        return {"tokenizers": [getattr(pipe, name) for name in self.tokenizer_folders],
                "pipeline_config": dict(pipe.config), "scheduler_config": dict(pipe.scheduler.config),
                "backbone_config": dict(getattr(pipe, self.configs_backbone.attribute).config),
                "vae_config": dict(pipe.vae.config)}

    def decoder_dtype(self, vae_config, dtype: torch.dtype) -> torch.dtype:
        """What the VAE decodes in for a pipeline in `dtype`: that dtype, except where the VAE's config
        says force_upcast (its activations overflow fp16, as SDXL's own VAE's do) and the pipeline runs
        fp16: then bf16, which has fp32's range and runs as fast as fp16 (diffusers decodes such a VAE
        in fp32, which on Hopper runs its convolutions at half the rate)."""
        return torch.bfloat16 if dtype == torch.float16 and vae_config.get("force_upcast", False) else dtype

    def vae_scale(self, vae_config) -> int:
        """Image pixels per latent pixel along each side, from the VAE's config."""
        return vae_scale_factor(vae_config)

    def _native_size(self, model, configs: dict, vae_scale: int) -> tuple[int, int]:
        """(height, width) the model draws when none is asked, as diffusers' pipelines default to it:
        the side it was trained at, the backbone's sample size in latent pixels times the VAE's scale
        factor (1024 for SDXL, 512 for SD 1.5)."""
        side = configs["backbone_config"]["sample_size"] * vae_scale
        return side, side

    def size_multiple(self, vae_scale: int, backbone_config: dict | None = None) -> int:
        """What image sides must be a multiple of: the VAE's scale, times a DiT's patch size (where
        known, from its backbone config)."""
        return vae_scale

    # --- its architectures ---------------------------------------------------------------------

    def build_pipeline(self, sizes, tokenizers: dict | None = None):
        """The family's diffusers pipeline at `sizes` (one of `sizes`' values, or a scene model's),
        random weights from SEED; `tokenizers` by kind ("clip", "t5"), else ones that encode any
        prompt."""
        raise NotImplementedError

    # --- its scene model -----------------------------------------------------------------------

    def scene_phases(self, pipe, latents: torch.Tensor, data, block, generator: torch.Generator) -> list:
        """How the scene model's backbones and text encoders learn on the VAE's latents (a list of
        training.ScenePhase): by default all of them together on the family's scene_loss."""
        from .training import ScenePhase

        trained = [getattr(pipe, name) for name in self.components if name != "vae"]
        return [ScenePhase("+".join(self.backbone_attributes), trained,
                           self.scene_loss(pipe, latents, data, block, generator), block.steps)]


class HookCaching:
    """Step caching through diffusers' cache hooks on the backbones (First Block Cache, TaylorSeer),
    for a family whose transformers take them: each backbone's stage hooked on its own module, so
    each keeps its own hook state. The family names its block lists (`hook_block_stacks`)."""

    cache_methods = ("none", "first_block", "taylorseer", "taylorseer_blocks")
    # The backbone's block lists, in the order its forward runs them.
    hook_block_stacks: tuple[str, ...]

    def step_cache(self, block):
        from ..runtime.cache_hooks import HookCache

        return HookCache.of_block(block, self.hook_block_stacks)

    def cache_stages(self, modules: dict, dtype, cache) -> dict:
        from ..runtime.cache_hooks import HookedStage

        stages = self.backbone_stages(modules, dtype)
        return {backbone.graph: HookedStage(stages[backbone.graph], modules[backbone.attribute],
                                            cache.for_backbone(backbone.attribute), backbone.attribute)
                for backbone in self.backbones}

    def release_cache(self, backbone) -> None:
        if backbone.is_cache_enabled:
            backbone.disable_cache()


def built_in(dtype: torch.dtype, device: torch.device, build):
    """`build()`'s modules created directly in `dtype` on `device` (the meta device: their sizes
    alone)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            return build()
    finally:
        torch.set_default_dtype(default)


def full_size_on_gpu(family: ModelFamily, size: str = "full", device: str = "cuda"):
    """`family`'s real model's architecture (or `size`'s, for a benchmark's dry run) with random
    weights in the family's GPU dtype, built directly on the GPU (seconds, not the minutes a CPU build
    and copy take); its scheduler's tables on the CPU, as pipelines expect."""
    pipe = built_in(family.gpu_dtype, torch.device(device), lambda: family.build_pipeline(family.sizes[size]))
    pipe.scheduler = pipe.scheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def vae_scale_factor(vae_config) -> int:
    """Image pixels per latent pixel along each side, as diffusers' pipelines compute it: 8 for SD
    and SDXL, 4 for the scene model's three-level VAE."""
    return 2 ** (len(vae_config["block_out_channels"]) - 1)
