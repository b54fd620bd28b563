"""Typed config schemas, registered in Hydra's ConfigStore.

The YAML files in ``conf/`` name these schemas first in their defaults list, so a misspelt key or
a value of the wrong type fails when Hydra composes the config, before any work starts. Range
checks that a type cannot express live in the ``validate_*`` functions, which every entry point
calls first.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from .errors import UserError


class QuantFormat(str, Enum):
    int8 = "int8"
    fp8 = "fp8"


def plain(value) -> str:
    """The YAML spelling of a config value (enum members come back from OmegaConf as enums)."""
    return value.value if isinstance(value, Enum) else str(value)


class Settled:
    """A schema block that settling makes read-only: below each script's edge the config is these
    plain dataclasses, and nothing changes them (dataclasses.replace makes a new, open one)."""

    def __setattr__(self, name: str, value) -> None:
        if self.__dict__.get("_settled"):
            raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}: the settled config is read-only")
        object.__setattr__(self, name, value)


def settled_config(cfg):
    """The composed Hydra config `cfg` as its schema's plain dataclasses, read-only; a mandatory
    value left unset (a LoRA adapter without its path) is refused in one line naming its key."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        what = ("the adapter's .safetensors file or folder" if missing[0].startswith("model.loras")
                else f"{missing[0]}=<value>")
        raise UserError(f"{missing[0]} is missing: give {what}")
    return freeze(OmegaConf.to_object(cfg))


def freeze(value):
    """`value` (a schema block, or lists and dicts of them) read-only, in place; returns it."""
    if isinstance(value, Settled):
        for field_value in vars(value).values():
            freeze(field_value)
        object.__setattr__(value, "_settled", True)
    elif isinstance(value, (list, tuple)):
        for item in value:
            freeze(item)
    elif isinstance(value, dict):
        for item in value.values():
            freeze(item)
    return value


COLLECT_METHODS = ("global_min", "min-max", "min-mean", "mean-max", "max")
PERCENTILE_LAYERS = ("auto", "conv", "all", "none")
MEAN_DIVISORS = ("n_steps", "runs")


@dataclass
class LoraAdapter(Settled):
    # A LoRA .safetensors file (diffusers, PEFT or kohya keys), or a folder holding one.
    path: str = MISSING
    # Its weight when fused: 0 leaves the model as it is. Typed Any so that a value that is no
    # number gets sdquant's one-line refusal naming the key, not Hydra's conversion trace.
    scale: Any = 1.0


@dataclass
class ModelConfig(Settled):
    name: str = MISSING
    # The family's name in sdquant.families' registry (sdxl, flux, wan, ...).
    family: str = MISSING
    # A hub id, a local diffusers folder or a single-file .safetensors checkpoint. For tiny
    # models it is the folder the model is built into on first use.
    source: str = MISSING
    tiny: bool = False
    # Offline config folder for single-file checkpoints (diffusers otherwise fetches it).
    single_file_config: Optional[str] = None
    variant: Optional[str] = None
    # The prompts quantize.py calibrates with when its prompts_file is null: a model trained on
    # its own captions (scenes_sdxl) ships them; null takes the package's SDXL-style prompts.
    calib_prompts: Optional[str] = None
    # The prompts evaluate.py scores when neither sampling.prompts nor sampling.prompts_file is given:
    # a model trained on its own captions ships held-out ones (scored for prompt adherence); null
    # takes the package's photo prompts.
    eval_prompts: Optional[str] = None
    # Another VAE to decode with, in place of the model's own: a diffusers VAE folder, a pipeline
    # folder holding vae/, or a hub id (e.g. an fp16-safe SDXL VAE); null: the model's own.
    vae_source: Optional[str] = None
    # What the VAE decodes in: auto takes the pipeline's dtype, or bf16 where the VAE's config says
    # force_upcast and the pipeline runs fp16 (SDXL's own VAE overflows fp16); fp16, bf16 or fp32.
    vae_dtype: str = "auto"
    # A video model's own size, frame count and frames per second (what sampling.height, .width,
    # .num_frames and .fps take when null; its diffusers folder states none of them). Image models
    # take their native size from their configs.
    height: Optional[int] = None
    width: Optional[int] = None
    num_frames: Optional[int] = None
    fps: Optional[int] = None
    # The classifier-free guidance the model is sampled with (Flux.1-dev's: the scale its guidance
    # embedding was distilled at), and a two-expert video model's for its second expert (null: the
    # first's): what sampling.* and quantize.* take when theirs are null.
    guidance_scale: float = 5.0
    guidance_scale_2: Optional[float] = None
    # Adapters fused into the UNet (and the text encoders, where they have weights for them)
    # before calibration, export and inference.
    loras: list[LoraAdapter] = field(default_factory=list)


@dataclass
class QuantizeBlock(Settled):
    """NeMo's ``quantize`` block plus what the calibration run itself needs."""

    exp_name: str = "nemo"
    n_steps: int = 20
    format: QuantFormat = QuantFormat.int8
    percentile: float = 1.0
    batch_size: int = 1
    calib_size: int = 32
    quant_level: float = 2.5
    alpha: float = 0.8
    collect_method: str = "min-mean"
    # Which activation quantizers Percentile Quant (collect_method, percentile) calibrates: conv
    # (NeMo's recipe: Conv2d inputs, while Linear inputs take their max ranges for SmoothQuant),
    # all (every activation quantizer), none (max everywhere); auto: conv for int8, none for fp8
    # (ModelOpt's diffusers example calibrates FP8 with max).
    percentile_layers: str = "auto"
    # min-mean's per-step mean divides the summed amaxes by n_steps (NeMo's and ModelOpt's example
    # calibrator: the range then grows with calib_size) or by the calibration runs (the true mean).
    mean_divisor: str = "n_steps"
    # None takes the model's (model.guidance_scale, model.guidance_scale_2); a two-expert video
    # model's second (low-noise) expert takes guidance_scale where both are null.
    guidance_scale: Optional[float] = None
    guidance_scale_2: Optional[float] = None
    # None takes the model's native resolution (and frame count, for a video model).
    height: Optional[int] = None
    width: Optional[int] = None
    num_frames: Optional[int] = None
    # A backbone of numbered blocks (Wan2.2's): the blocks kept in 16 bits; None takes the family's
    # recipe (Wan2.2: 0-2 and 37-39, as ModelOpt's filter), [] quantizes every block.
    high_precision_blocks: Optional[list[int]] = None


@dataclass
class InferBlock(Settled):
    """NeMo's ``infer`` block of the export config."""

    out_path: str = "sdxl_export"
    # The engines' image size; None takes the model's native size (1024 for SDXL), and for a video
    # model its frame count.
    width: Optional[int] = None
    height: Optional[int] = None
    num_frames: Optional[int] = None
    # Images per prompt batch: the optimal batch of the engine profiles and the dummy batch.
    batch_size: int = 2


@dataclass
class TrtBlock(Settled):
    """NeMo's ``trt`` block (the engines' batch range, counted in images) and how to build."""

    static_batch: bool = False
    min_batch_size: int = 1
    max_batch_size: int = 8
    backend: str = "auto"          # auto | tensorrt | tensorrt_rtx
    builder: str = "python"        # python (TensorRT's Python API) | trtexec
    builder_optimization_level: int = 4
    workspace_gb: Optional[float] = None
    # None: <out_path>/plan/timing.cache, shared by every build.
    timing_cache: Optional[str] = None
    # TensorRT for RTX only: the GPU generations to compile for (SM75 ... SM121); empty takes
    # the GPU at hand, or SM89 where there is none.
    rtx_compute_capabilities: list[str] = field(default_factory=list)
    # Engines whose weights a refit (export_trt.py run_refit=true) can replace with those of
    # other LoRA adapters; 8-bit UNets stay fixed (their scales need recalibration).
    refittable: bool = False
    # The longest prompt the UNet engine takes with sampling.long_prompts=chunk, in CLIP windows
    # (75 tokens each): its context length ranges from 77 to 77 times this.
    max_prompt_chunks: int = 2


@dataclass
class OnnxBlock(Settled):
    opset: int = 19
    # fp16 halves the graph and is what TensorRT builds strongly typed; fp32 is for checking.
    precision: str = "fp16"
    # SDXL's VAE overflows in fp16, so it stays fp32 unless asked.
    vae_precision: str = "fp32"
    # Side of the latent the graphs are traced at; height and width stay dynamic in the graph,
    # so a small trace costs far less time and memory than the real resolution.
    trace_latent_size: int = 16


@dataclass
class QuantizeApp(Settled):
    quantize: QuantizeBlock = field(default_factory=QuantizeBlock)
    model: ModelConfig = MISSING
    # None takes the model's own calibration prompts (model.calib_prompts), else the package's.
    prompts_file: Optional[str] = None
    out_dir: str = "quantized"
    seed: int = 42
    force: bool = False
    device: str = "auto"
    # auto: fp16 on a GPU, fp32 on a CPU (where fp32 kernels are the fast ones).
    dtype: str = "auto"
    # On a GPU, run the UNet and the recording as a CUDA graph (same statistics, less host time).
    cuda_graph: bool = True
    # On a GPU, keep only the network in use there (diffusers' model CPU offload), the rest in host
    # memory: a two-expert video model's experts then take one expert's memory, not both (its
    # backbones then run without CUDA graphs, as offloading moves them).
    cpu_offload: bool = False
    # NeMo's switches: one job can calibrate, export ONNX and build engines, each step reusing
    # what an earlier run left. run_quantization=false only takes an existing checkpoint.
    run_quantization: bool = True
    run_onnx_export: bool = False
    run_trt_export: bool = False
    # export_trt.py's blocks, for the export steps. A relative infer.out_path lands inside the
    # checkpoint's folder, so sweep jobs never export into one another's.
    infer: InferBlock = field(default_factory=InferBlock)
    trt: TrtBlock = field(default_factory=TrtBlock)
    onnx: OnnxBlock = field(default_factory=OnnxBlock)


@dataclass
class CacheBlock(Settled):
    """Step caching: what a denoising step reuses from an earlier one."""

    # none; deepcache (UNets): the whole UNet every `interval` steps, only its outer blocks
    # between, which take the deep blocks' feature from the last whole pass;
    # for transformers, diffusers' own cache hooks: first_block (the rest of the transformer is
    # skipped while the first block's output changes less than `threshold`), taylorseer (the
    # attention modules' outputs predicted by a Taylor series between full passes every `interval`
    # steps: diffusers' default) or taylorseer_blocks (whole blocks predicted, so a predicted step
    # runs none of their GEMMs).
    method: str = "none"
    interval: int = 2
    # The skip branches that stay live, counted in blocks: 0 keeps the outermost down and up block, 1
    # the next pair too. DeepCache's reference package counts layers: its cache_branch_id is 3 * branch + 2.
    branch: int = 0
    threshold: float = 0.05
    # TaylorSeer's full passes at a transformer's (each expert's) first calls of a sample, before it
    # predicts any (diffusers' disable_cache_before_step). A Wan expert's hook starts afresh where it
    # takes over, so each expert pays them: at 3, a 20-step A14B video runs 13 full passes, at 1, 11.
    warmup: int = 3
    # TaylorSeer's `interval` for the named backbones (by attribute), the others keeping `interval`:
    # a Wan2.2 low-noise expert's output changes far less from step to step than the high-noise
    # one's, so it can predict more of its steps ({transformer_2: 4}).
    backbone_intervals: dict[str, int] = field(default_factory=dict)
    # First Block Cache's `threshold` for the named backbones, the others keeping `threshold`: at one
    # threshold a Wan2.2 low-noise expert skips more of its calls than the high-noise one.
    backbone_thresholds: dict[str, float] = field(default_factory=dict)
    # First Block Cache on a fixed schedule for the named backbones: the steps (counted from each
    # backbone's first call of a sample, 0 first) that run in full, the others skipped, in place of
    # the threshold's decision. A schedule recorded from the threshold's decisions on validation
    # prompts gives each request the same work: a latency known before the call and no host sync
    # per call to read the first block's change.
    backbone_full_steps: dict[str, list[int]] = field(default_factory=dict)
    # TaylorSeer's highest order (diffusers' max_order): 1 extrapolates along the line through the
    # last two full passes' outputs, 2 adds a second-order term from the last three passes' differences.
    order: int = 1


CACHE_METHODS = ("none", "deepcache", "first_block", "taylorseer", "taylorseer_blocks")


@dataclass
class ExportApp(Settled):
    infer: InferBlock = field(default_factory=InferBlock)
    trt: TrtBlock = field(default_factory=TrtBlock)
    onnx: OnnxBlock = field(default_factory=OnnxBlock)
    model: ModelConfig = MISSING
    # A checkpoint folder (or its unet.mto) from quantize.py; None exports the 16-bit backbone.
    quantized_backbone: Optional[str] = None
    # NeMo's name for quantized_backbone.
    quantized_unet: Optional[str] = None
    force: bool = False
    device: str = "auto"
    # NeMo-style switches: one job can export and build, or only one of them.
    run_onnx_export: bool = True
    run_trt_export: bool = True
    # Instead of both: write the weights of model.loras into the refittable engines in
    # infer.out_path (built with trt.refittable=true), without exporting or rebuilding.
    run_refit: bool = False
    # The step cache the engines are for: deepcache also exports and builds the UNet's full and
    # shallow passes (unet_xl_full, unet_xl_shallow) for its `branch`; `interval` is sampling's.
    cache: CacheBlock = field(default_factory=CacheBlock)


@dataclass
class ShardBlock(Settled):
    """This job's share of the prompt batches when independent jobs (Slurm array tasks) split them:
    batch i goes to the job whose index is i mod count (within it, to torchrun rank i mod ranks)."""

    index: int = 0
    count: int = 1


@dataclass
class ParallelBlock(Settled):
    """How the processes of one torchrun share each sample (infer_trt.py, backend=torch): cfg=2 runs
    the conditional and unconditional halves of every backbone call on two processes, ulysses=N
    splits each backbone call's tokens over N (Ulysses attention, through diffusers' context
    parallelism). The processes form world size / (cfg x ulysses) groups, which share the prompt
    batches as data-parallel ranks do."""

    cfg: int = 1
    ulysses: int = 1


@dataclass
class SamplingBlock(Settled):
    # null (evaluate.py's default): the model's evaluation prompts (model.eval_prompts).
    prompts: Optional[list[str]] = field(default_factory=lambda: ["a photo of an astronaut riding a horse on mars"])
    # A file of prompts, one a line, used instead of `prompts` when set.
    prompts_file: Optional[str] = None
    negative_prompt: str = ""
    steps: int = 30
    # None takes the model's (model.guidance_scale).
    guidance_scale: Optional[float] = None
    seed: int = 42
    # None takes the model's native size (1024 for SDXL, 512 for SD 1.5, 64 for scenes_sdxl).
    width: Optional[int] = None
    height: Optional[int] = None
    # A video's frames (4k+1 for Wan2.2) and frames per second in the written file; None takes the
    # model's own (model.num_frames, model.fps). Images are one frame.
    num_frames: Optional[int] = None
    fps: Optional[int] = None
    # A two-expert video model's guidance for its second (low-noise) expert; None: the model's
    # (model.guidance_scale_2), else guidance_scale, as diffusers' WanPipeline defaults it.
    guidance_scale_2: Optional[float] = None
    # Prompts per pipeline call; each call makes batch_size * num_images_per_prompt images.
    batch_size: int = 1
    # Images of each prompt (diffusers' name), each with its own seed: the run's k-th image, counted
    # over all prompts, is seeded seed + k.
    num_images_per_prompt: int = 1
    # None: the family's (euler for SD and SDXL, flow_euler for Flux).
    scheduler: Optional[str] = None
    # Prompts past what the text encoders read (CLIP's 77 tokens; T5's length for Flux and SD3.5):
    # truncate (cut, as diffusers does, saying which words are dropped), chunk (UNets: encoded in
    # 77-token windows whose embeddings are joined) or error (refused before any work).
    long_prompts: str = "truncate"
    cache: CacheBlock = field(default_factory=CacheBlock)


LONG_PROMPTS = ("truncate", "chunk", "error")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
# The modes whose compiled code replays CUDA graphs of its own.
CAPTURING_COMPILE_MODES = ("reduce-overhead", "max-autotune")
TORCH_QUANTIZED = ("fake", "fp8", "int8")
TORCH_ATTENTION = ("auto", "fp8", "fp16")
TORCH_ATTENTION_KERNELS = ("auto", "flash3", "torch")


@dataclass
class AttentionWindowBlock(Settled):
    """A video backbone's self-attention within a window of latent frames (sdquant.runtime.attention_window)."""

    # Each query attends to the keys of the latent frames within this many of its own, either side
    # (null: to every key): one attention call per latent frame, on the layer's own kernels.
    frames: Optional[int] = None
    # The backbones (by attribute, e.g. [transformer_2], the A14B's low-noise expert) whose attention
    # is windowed; null: all.
    backbones: Optional[list[str]] = None
    # Blocks (by index) whose self-attention stays over every frame.
    dense_blocks: list[int] = field(default_factory=list)
    # A file of each head's share of attention inside the window (written by record_to): only the
    # heads whose share is at least min_share attend within it, the others to every key. Heads
    # differ, some near-local, some global, so a window for every head loses what one for the
    # local ones keeps. null: every head of the chosen layers.
    heads_file: Optional[str] = None
    min_share: float = 0.9
    # infer_trt.py draws with every key and writes each windowable head's share of attention inside
    # the window of `frames`, over the prompts drawn, to this file (for heads_file).
    record_to: Optional[str] = None


@dataclass
class TorchBackendBlock(Settled):
    """How backend=torch runs the diffusers modules."""

    # torch.compile the UNet and the VAE decoder (channels-last, and for an unquantized UNet
    # fused q/k/v projections, as diffusers' own speed recipe does; Wan's decoder stays eager:
    # ModelFamily.compiles_decoder). Each new input shape compiles again (one to three minutes
    # for a full-size SDXL) unless dynamic is true.
    compile: bool = False
    compile_mode: str = "default"
    dynamic: bool = False
    # The compiler times a few tile sizes for each of its fused pointwise and normalisation kernels
    # (inductor's coordinate descent tuning, part of max-autotune) and keeps the fastest. Measured
    # on full-size Flux (H100): 1% faster calls, first calls 2-3x longer (330 s against 105 s).
    tune_kernels: bool = False
    # quantized_backbone as ModelOpt's fake quantization (any checkpoint), or in its own format: fp8
    # (format=fp8) or int8 (format=int8): its Linear layers as FP8 or INT8 GEMMs (FP8's q/k/v reading
    # one input as one), its convolutions on values rounded to that format and, for a quant_level=4
    # FP8 checkpoint, its attention as cuDNN's FP8 attention.
    quantized: str = "fake"
    # Under quantized=fp8: auto runs FP8 attention where the checkpoint calibrated it (level 4),
    # fp16 keeps every attention in the model's 16 bits, fp8 insists (refusing a checkpoint
    # without attention ranges).
    attention: str = "auto"
    # The backbones' attention kernels, 16-bit and FP8: torch's (scaled_dot_product_attention, and
    # cuDNN's FP8 attention), flash3 (FlashAttention-3, Hopper only, from fa3-fwd or a source build:
    # faster than both at a video's 75,600 tokens), or auto (flash3 where it is installed and the GPU
    # is a Hopper).
    attention_kernel: str = "auto"
    # A video backbone's self-attention within a window of latent frames: less to compute, at a cost in
    # quality that docs/models.md gives per setting.
    attention_window: AttentionWindowBlock = field(default_factory=AttentionWindowBlock)
    # Images the VAE decodes at a time (0: the whole batch at once). The decoder's activations at
    # 1024x1024 dwarf the backbone's, so one at a time lowers the peak of an 8-image batch by
    # several GiB; under compile the decoder compiles for that many images (and once more for a
    # smaller last slice).
    vae_batch: int = 1


@dataclass
class InferApp(Settled):
    """NeMo's inference config: the engines and out_path, plus sampling and timing."""

    # export_trt.py's engines: each graph's <engine_dir>/<graph>.plan, and for backend=onnxruntime
    # its ONNX file <engine_dir>/../onnx/<graph>/model.onnx.
    engine_dir: str = "sdxl_export/plan"
    # A graph's engine (or .onnx file) from elsewhere, by graph name: +engines.transformer=<file>.
    engines: dict[str, str] = field(default_factory=dict)
    # NeMo's keys, kept: unet_xl names the backbone's engine, clip1, clip2 and vae SDXL's others.
    unet_xl: Optional[str] = None
    clip1: Optional[str] = None
    clip2: Optional[str] = None
    vae: Optional[str] = None
    out_path: str = "trt_output"
    # trt: the engines; onnxruntime: their ONNX files; torch: the diffusers modules themselves (with
    # quantized_backbone's 8-bit backbone if set).
    backend: str = "trt"
    onnx_providers: list[str] = field(default_factory=lambda: ["CPUExecutionProvider"])
    quantized_backbone: Optional[str] = None
    # NeMo's name for quantized_backbone.
    quantized_unet: Optional[str] = None
    sampling: SamplingBlock = field(default_factory=SamplingBlock)
    # Extra runs of the first prompt batch after every batch is drawn, a benchmark's option: the
    # warm-up ones untimed, the timed ones making the latency report (0: the report comes from the
    # drawing itself, its first call apart from the later ones).
    num_warmup_runs: int = 0
    num_timed_runs: int = 0
    cuda_graph: bool = False
    torch_backend: TorchBackendBlock = field(default_factory=TorchBackendBlock)
    shard: ShardBlock = field(default_factory=ShardBlock)
    parallel: ParallelBlock = field(default_factory=ParallelBlock)
    model: ModelConfig = MISSING
    device: str = "auto"



@dataclass
class ServeBlock(Settled):
    """serve.py's server: where it listens, who may call it, how requests are batched and bounded."""

    # 127.0.0.1: this machine alone; 0.0.0.0 (with an API key) to take requests from others.
    host: str = "127.0.0.1"
    port: int = 8000
    # Replicas of the pipeline (data parallel), each loaded and warmed once, placed by Ray on any
    # node of the cluster with the GPUs (and CPUs) each asks for.
    num_replicas: int = 1
    # None: one GPU a replica, none where device=cpu.
    gpus_per_replica: Optional[float] = None
    cpus_per_replica: float = 1.0
    # Images a pipeline call draws at most, from one request or several that share its settings:
    # the engines' profile batch on backend=trt.
    max_batch_size: int = 8
    # How long a call waits for more requests to join it once the first has come (while the
    # pipeline is busy, those that arrive wait for the next call anyway).
    batch_wait_timeout_s: float = 0.05
    # The batches each replica warms at start (and serve.max_batch_size): a call pads to the
    # smallest of them that holds its images, so no request compiles a new batch while others wait.
    warm_batches: list[int] = field(default_factory=lambda: [1])
    # Requests admitted beyond those the replicas hold in their calls; past it a request is refused
    # at once with 503 and Retry-After.
    max_queued_requests: int = 64
    max_images_per_request: int = 4
    # A request's steps at most: a call's time grows with them.
    max_steps: int = 100
    max_prompt_chars: int = 2000
    max_body_bytes: int = 65536
    # A key every /v1 request must give as `Authorization: Bearer <key>`; or the name of an
    # environment variable that holds it (kept out of the config and the command line).
    api_key: Optional[str] = None
    api_key_env: Optional[str] = None
    # Ctrl-C or SIGTERM: new requests are refused and those admitted get this long to finish.
    drain_timeout_s: float = 60.0
    # Finished video jobs kept for GET /v1/videos/{id} (the oldest goes first).
    kept_video_jobs: int = 64
    # A Ray cluster to join (auto: the one `ray start --head` runs on this machine; ray://host:10001
    # or host:6379); empty: a cluster of this machine alone, started and stopped with the server.
    address: str = ""


@dataclass
class ServeApp(InferApp):
    """serve.py: the inference config's model, backend and sampling defaults, plus the server."""

    serve: ServeBlock = field(default_factory=ServeBlock)

LPIPS_NETS = ("alex", "vgg", "squeeze")


@dataclass
class MetricsBlock(Settled):
    """The optional image metrics; each is skipped with a note when its weights are not on this
    machine, since nothing is downloaded at run time."""

    # torchmetrics' LPIPS backbone (alex | vgg | squeeze); null turns LPIPS off.
    lpips_net: Optional[str] = "alex"
    # A CLIP model folder, or a hub id already in the local Hugging Face cache; null turns it off.
    clip_model: Optional[str] = "openai/clip-vit-large-patch14"


@dataclass
class EvaluateApp(Settled):
    """Quantized UNets against the model's own fp16 UNet, from identical initial latents."""

    model: ModelConfig = MISSING
    # name -> a quantize.py checkpoint (run as ModelOpt fake quant), a UNet .onnx file (ONNX
    # Runtime) or a UNet engine (.plan, TensorRT); null runs the fp16 UNet again, as a self-check.
    variants: dict[str, Optional[str]] = field(default_factory=dict)
    # name -> the step cache that variant runs with; the others run with sampling.cache, the fp16
    # reference always without one.
    variant_cache: dict[str, CacheBlock] = field(default_factory=dict)
    # name -> the attention window that variant runs with (torch_backend.attention_window's keys);
    # the others run with torch_backend.attention_window, the reference always without one. An
    # unquantized variant with a window runs on a copy of the reference's backbones (their memory twice).
    variant_window: dict[str, AttentionWindowBlock] = field(default_factory=dict)
    # No prompts: the model's evaluation prompts (model.eval_prompts).
    sampling: SamplingBlock = field(default_factory=lambda: SamplingBlock(prompts=None))
    shard: ShardBlock = field(default_factory=ShardBlock)
    metrics: MetricsBlock = field(default_factory=MetricsBlock)
    onnx_providers: list[str] = field(default_factory=lambda: ["CPUExecutionProvider"])
    # How checkpoint variants run: ModelOpt's fake quantization, or converted to their format's
    # kernels (quantized=fp8|int8, attention), as infer_trt.py backend=torch runs them; on a CPU the
    # kernels' twins, which the GPU tests hold the kernels against. compile stays off here.
    torch_backend: TorchBackendBlock = field(default_factory=TorchBackendBlock)
    out_path: str = "quality"
    device: str = "auto"
    dtype: str = "auto"


@dataclass
class VaeTraining(Settled):
    steps: int = 4000
    batch_size: int = 128
    learning_rate: float = 1e-3
    # Weight of the KL term: small, so the latent keeps detail, as in Stable Diffusion's VAE.
    kl_weight: float = 1e-6
    # Replay the step's forward and backward as CUDA graphs (a CUDA device only): the Wan VAE steps
    # through its frames in Python, thousands of small kernels a step whose launches the GPU waits
    # on, and torch.compile recompiles at each chunk of frames.
    cuda_graph: bool = False


@dataclass
class DenoiserTraining(Settled):
    """The denoiser (UNet or transformer) and the text encoders, trained together."""

    steps: int = 4500
    batch_size: int = 512
    learning_rate: float = 5e-4
    # Share of captions dropped (to zeros for SDXL, as its pipeline feeds an empty negative prompt;
    # to the empty caption for Flux and Wan, what diffusers' true CFG and WanPipeline feed), for
    # classifier-free guidance.
    empty_caption_rate: float = 0.1
    ema_decay: float = 0.999
    # torch.compile the step's forward and backward: at the scene models' sizes the GPU waits on
    # kernel launches, which fusing cuts.
    compile: bool = False


@dataclass
class SceneTrainingApp(Settled):
    """What the training of every family's built-in scene model takes (tools/train_scene_model.py);
    each family's schema (its package's scene.py) sets its out_dir, family and architecture."""

    # The diffusers folder written.
    out_dir: str = MISSING
    # The family whose architecture is trained (its scene sizes, loss and tokenizers).
    family: str = MISSING
    # Rendered training scenes (jittered); each is seen many times over the steps.
    dataset_size: int = 65536
    # The share of them that hold two objects (the rest hold one).
    two_object_share: float = 0.5
    seed: int = 0
    device: str = "auto"
    force: bool = False
    # A scene model folder trained before whose VAE this run keeps instead of training one (its
    # vae.* settings and architecture's VAE sizes are then not used): the denoisers can be trained
    # again on one autoencoder, in a device call of their own. Its training time is counted in.
    vae_from: Optional[str] = None
    # The family's architecture (its schema's dataclass), declared here so that it keeps its place
    # among the keys of every scene config and training record.
    architecture: Any = MISSING
    vae: VaeTraining = field(default_factory=VaeTraining)
    denoiser: DenoiserTraining = field(default_factory=DenoiserTraining)
    # Held-out prompts of each kind (one object, two objects) scored at the end (0 skips it),
    # sampled as docs/scene-models.md's figures are.
    eval_prompts: int = 64
    eval_steps: int = 20
    guidance_scale: float = 5.0


def shipped_model_folder(name: str) -> str:
    """Where a model shipped inside the package lives, wherever the package is installed."""
    return str(Path(__file__).resolve().parent / "models" / name)


def cache_folder(name: str = "") -> str:
    """Where sdquant builds what it makes on first use (the tiny models): $SDQUANT_CACHE, else
    ~/.cache/sdquant."""
    root = Path(os.environ.get("SDQUANT_CACHE") or "~/.cache/sdquant").expanduser()
    return str(root / name)


def register_schemas(more: dict | None = None) -> None:
    """Stores the scripts' schemas in Hydra's ConfigStore, and `more` (name: schema, as the families'
    scene_schemas gives them), before Hydra composes a config."""
    OmegaConf.register_new_resolver("sdquant_model", shipped_model_folder, replace=True)
    OmegaConf.register_new_resolver("sdquant_cache", cache_folder, replace=True)
    store = ConfigStore.instance()
    store.store(name="quantize_schema", node=QuantizeApp)
    store.store(name="export_schema", node=ExportApp)
    store.store(name="infer_schema", node=InferApp)
    store.store(name="serve_schema", node=ServeApp)
    store.store(name="evaluate_schema", node=EvaluateApp)
    store.store(group="model", name="model_schema", node=ModelConfig)
    for name, node in (more or {}).items():
        store.store(name=name, node=node)


def validate_quantize_block(block: QuantizeBlock) -> None:
    """Refuses settings that no run could honour, naming the key and what to do (the levels a
    model has are its family's to say: sdquant.runs.quantize)."""
    level = float(block.quant_level)
    if level == 4.0 and QuantFormat(block.format) != QuantFormat.fp8:
        raise UserError(
            "quantize.quant_level=4 quantizes attention in FP8 and needs quantize.format=fp8; "
            "use quant_level 3 for int8"
        )
    if block.collect_method not in COLLECT_METHODS:
        raise UserError(
            f"quantize.collect_method={block.collect_method!r} is unknown: choose one of "
            f"{', '.join(COLLECT_METHODS)}"
        )
    if block.percentile_layers not in PERCENTILE_LAYERS:
        raise UserError(f"quantize.percentile_layers={block.percentile_layers!r} is unknown: choose one of "
                        f"{', '.join(PERCENTILE_LAYERS)}")
    if block.mean_divisor not in MEAN_DIVISORS:
        raise UserError(f"quantize.mean_divisor={block.mean_divisor!r} is unknown: choose n_steps or runs")
    if not 0.0 < block.percentile <= 1.0:
        raise UserError(f"quantize.percentile={block.percentile} is outside (0, 1]")
    if not 0.0 <= block.alpha <= 1.0:
        raise UserError(f"quantize.alpha={block.alpha} is outside [0, 1]")
    if block.n_steps < 1:
        raise UserError(f"quantize.n_steps={block.n_steps} must be at least 1")
    if int(block.n_steps * block.percentile) < 1:
        raise UserError(
            f"quantize.percentile={block.percentile} keeps no step of quantize.n_steps="
            f"{block.n_steps}: raise one of them so that n_steps * percentile >= 1"
        )
    if block.batch_size < 1:
        raise UserError(f"quantize.batch_size={block.batch_size} must be at least 1")
    if block.calib_size < block.batch_size or block.calib_size % block.batch_size:
        raise UserError(
            f"quantize.calib_size={block.calib_size} must be a multiple of quantize.batch_size="
            f"{block.batch_size} and not smaller"
        )


PRECISIONS = ("fp16", "fp32")


def validate_profile(infer: InferBlock, trt: TrtBlock) -> None:
    """Refuses a batch range that no engine profile can hold, before any work."""
    if infer.batch_size < 1:
        raise UserError(f"infer.batch_size={infer.batch_size} must be at least 1")
    if not trt.static_batch and not 1 <= trt.min_batch_size <= infer.batch_size <= trt.max_batch_size:
        raise UserError(
            f"batch sizes must satisfy 1 <= trt.min_batch_size ({trt.min_batch_size}) <= "
            f"infer.batch_size ({infer.batch_size}) <= trt.max_batch_size ({trt.max_batch_size})"
        )


def validate_export(infer: InferBlock, trt: TrtBlock, onnx: OnnxBlock) -> None:
    validate_profile(infer, trt)
    if trt.builder not in ("python", "trtexec"):
        raise UserError(f"trt.builder={trt.builder!r} is unknown: choose python or trtexec")
    if trt.max_prompt_chunks < 1:
        raise UserError(f"trt.max_prompt_chunks={trt.max_prompt_chunks} must be at least 1")
    if trt.refittable and trt.builder == "trtexec":
        raise UserError("trt.refittable=true marks each weight refittable through the Python API: set "
                        "trt.builder=python")
    if not 0 <= trt.builder_optimization_level <= 5:
        raise UserError(f"trt.builder_optimization_level={trt.builder_optimization_level} is outside 0..5")
    for key in ("precision", "vae_precision"):
        if getattr(onnx, key) not in PRECISIONS:
            raise UserError(f"onnx.{key}={getattr(onnx, key)!r} is unknown: choose fp16 or fp32")
    if onnx.opset < 19:
        raise UserError(f"onnx.opset={onnx.opset}: 8-bit graphs with fp16 scales need opset 19 or newer")
    validate_image_size(sizes_of(infer), "infer.")
    if onnx.trace_latent_size < 8 or onnx.trace_latent_size % 8:
        raise UserError(f"onnx.trace_latent_size={onnx.trace_latent_size} must be a positive multiple of 8")


INFER_BACKENDS = ("trt", "onnxruntime", "torch")


def quantized_backbone(app) -> tuple[str, str | None]:
    """The quantize.py checkpoint a script runs, and the key that named it: quantized_backbone, or
    quantized_unet, NeMo's name for it (giving both, apart, is refused)."""
    if app.quantized_unet and app.quantized_backbone and app.quantized_unet != app.quantized_backbone:
        raise UserError(f"quantized_backbone={app.quantized_backbone} and quantized_unet={app.quantized_unet} name "
                        "two checkpoints: quantized_unet is NeMo's name for quantized_backbone, give one of them")
    if app.quantized_unet:
        return "quantized_unet", app.quantized_unet
    return "quantized_backbone", app.quantized_backbone


def validate_shard(shard) -> None:
    if shard.count < 1 or not 0 <= shard.index < shard.count:
        raise UserError(f"shard.index={shard.index} shard.count={shard.count}: give a count of 1 or more and an "
                        "index from 0 to count - 1 (e.g. shard.index=$SLURM_ARRAY_TASK_ID)")


def validate_infer(app) -> None:
    validate_shard(app.shard)
    if app.backend not in INFER_BACKENDS:
        raise UserError(f"backend={app.backend!r} is unknown: choose {', '.join(INFER_BACKENDS)}")
    torch_block = app.torch_backend
    if torch_block.compile_mode not in COMPILE_MODES:
        raise UserError(f"torch_backend.compile_mode={torch_block.compile_mode!r} is unknown: choose "
                        f"{', '.join(COMPILE_MODES)}")
    validate_torch_kernels(torch_block)
    checkpoint_key, checkpoint = quantized_backbone(app)
    if app.backend != "torch" and (torch_block.compile or torch_block.quantized != "fake" or checkpoint
                                   or torch_block.vae_batch != TorchBackendBlock.vae_batch):
        raise UserError(f"torch_backend.compile, .quantized, .vae_batch and {checkpoint_key} apply to backend=torch, "
                        f"not backend={app.backend}: the {app.backend} backend runs the exported graphs as built")
    if torch_block.quantized != "fake" and not checkpoint:
        raise UserError(f"torch_backend.quantized={torch_block.quantized} runs a quantize.py checkpoint: set "
                        "quantized_backbone=<folder>")
    validate_sampling(app.sampling)
    validate_parallel(app.parallel, app.backend)
    if app.backend == "onnxruntime":
        validate_providers(app.onnx_providers)
    if app.num_warmup_runs and not app.num_timed_runs:
        raise UserError(f"num_warmup_runs={app.num_warmup_runs} warms up the timed runs, and num_timed_runs=0 asks for "
                        "none: set num_timed_runs too, or num_warmup_runs=0")
    if app.num_timed_runs < 0 or app.num_warmup_runs < 0:
        raise UserError(f"num_warmup_runs={app.num_warmup_runs} num_timed_runs={app.num_timed_runs}: give 0 or more "
                        "(runs of the first prompt batch after the drawing, timed for the report; 0: the drawing's own)")


def validate_parallel(block, backend: str) -> None:
    """The values alone; what the model, the guidance and the process count allow is checked where
    the sampling is settled (sdquant.parallel.check_split)."""
    if block.cfg not in (1, 2):
        raise UserError(f"parallel.cfg={block.cfg}: 1, or 2 to run the conditional and unconditional halves of each "
                        "backbone call on two processes")
    if block.ulysses < 1:
        raise UserError(f"parallel.ulysses={block.ulysses}: the processes each backbone call's tokens are split "
                        "over, 1 or more")
    if (block.cfg > 1 or block.ulysses > 1) and backend != "torch":
        raise UserError(f"parallel.cfg={block.cfg} parallel.ulysses={block.ulysses} split the diffusers modules' "
                        f"calls: run them with backend=torch, not backend={backend}")


def validate_torch_kernels(torch_block) -> None:
    """Refuses kernel settings (torch_backend.quantized, .attention, .attention_kernel) that no
    checkpoint could run, kernel tuning without compiling, and a VAE batch that is not one."""
    if torch_block.tune_kernels and not torch_block.compile:
        raise UserError("torch_backend.tune_kernels=true tunes the kernels torch.compile makes: set "
                        "torch_backend.compile=true too")
    if torch_block.vae_batch < 0:
        raise UserError(f"torch_backend.vae_batch={torch_block.vae_batch}: give the images the VAE decodes at a time, "
                        "or 0 for the whole batch at once")
    if torch_block.quantized not in TORCH_QUANTIZED:
        raise UserError(f"torch_backend.quantized={torch_block.quantized!r} is unknown: choose "
                        f"{', '.join(TORCH_QUANTIZED)}")
    if torch_block.attention not in TORCH_ATTENTION:
        raise UserError(f"torch_backend.attention={torch_block.attention!r} is unknown: choose "
                        f"{', '.join(TORCH_ATTENTION)}")
    if torch_block.attention_kernel not in TORCH_ATTENTION_KERNELS:
        raise UserError(f"torch_backend.attention_kernel={torch_block.attention_kernel!r} is unknown: choose "
                        f"{', '.join(TORCH_ATTENTION_KERNELS)}")
    validate_attention_window(torch_block.attention_window, "torch_backend.attention_window")
    if torch_block.attention != "auto" and torch_block.quantized != "fp8":
        raise UserError(f"torch_backend.attention={torch_block.attention} applies to torch_backend.quantized=fp8 (fake "
                        "quantization runs attention as the checkpoint does): set torch_backend.quantized=fp8")


def validate_attention_window(window: AttentionWindowBlock, key: str) -> None:
    """The window's values alone; what the model allows is checked where the run is settled
    (sdquant.runtime.attention_window.check_attention_window)."""
    if window.frames is not None and window.frames < 1:
        raise UserError(f"{key}.frames={window.frames}: give the latent frames each query attends to either side "
                        "of its own (1 or more), or null for every frame")
    if any(index < 0 for index in window.dense_blocks) or len(set(window.dense_blocks)) != len(window.dense_blocks):
        raise UserError(f"{key}.dense_blocks={list(window.dense_blocks)}: give each block's index (0 or more) once")
    if (window.heads_file or window.record_to) and window.frames is None:
        raise UserError(f"{key}.{'heads_file' if window.heads_file else 'record_to'}: give {key}.frames, the window "
                        "the heads' shares are of")
    if window.heads_file and window.record_to:
        raise UserError(f"{key}.record_to: a recording draws with every key; drop {key}.heads_file for it")
    if not 0 < window.min_share <= 1:
        raise UserError(f"{key}.min_share={window.min_share}: give a share of attention in (0, 1]")


def validate_providers(providers) -> None:
    import onnxruntime

    available = onnxruntime.get_available_providers()
    unknown = [name for name in providers if name not in available]
    if unknown or not providers:
        raise UserError(f"onnx_providers={list(providers)}: {', '.join(unknown) or 'none given'}; this ONNX Runtime "
                        f"has {', '.join(available)}")


def validate_evaluate(app) -> None:
    validate_shard(app.shard)
    validate_sampling(app.sampling)
    validate_providers(app.onnx_providers)
    if not app.variants:
        raise UserError("no variants to evaluate: add one per quantized UNet, e.g. "
                        "+variants.int8=quantized/<checkpoint folder>")
    for name, block in app.variant_cache.items():
        if name not in app.variants:
            raise UserError(f"variant_cache.{name}: there is no variants.{name} to run with it")
        if block.method not in CACHE_METHODS:
            raise UserError(f"variant_cache.{name}.method={block.method!r} is unknown: choose "
                            f"{' or '.join(CACHE_METHODS)}")
    for name, window in app.variant_window.items():
        if name not in app.variants:
            raise UserError(f"variant_window.{name}: there is no variants.{name} to run with it")
        validate_attention_window(window, f"variant_window.{name}")
    if app.torch_backend.compile or app.torch_backend.tune_kernels:
        raise UserError("torch_backend.compile, .tune_kernels: evaluate.py runs the modules as they are, eagerly; "
                        "compiling is infer_trt.py's (backend=torch)")
    validate_torch_kernels(app.torch_backend)
    if app.metrics.lpips_net is not None and app.metrics.lpips_net not in LPIPS_NETS:
        raise UserError(f"metrics.lpips_net={app.metrics.lpips_net!r} is unknown: choose "
                        f"{', '.join(LPIPS_NETS)} or null")


def validate_train_scene(app) -> None:
    """Refuses settings no scene model's training could honour; the family checks its own
    architecture when training starts (sdquant.families.scene_family)."""
    if app.vae_from is not None:
        earlier = Path(app.vae_from).expanduser()
        if not all((earlier / name).is_file() for name in ("vae/config.json", "training.json", "loss_log.csv")):
            raise UserError(f"vae_from={app.vae_from}: not a scene model folder written by tools/train_scene_model.py "
                            "(it needs vae/, training.json and loss_log.csv): give such a folder, or null to train the VAE")
        trained_for = json.loads((earlier / "training.json").read_text()).get("family")
        if trained_for != app.family:
            raise UserError(f"vae_from={app.vae_from}: a {trained_for} scene model's folder, and this run trains a "
                            f"{app.family} one: give one of its own family")
    for key in ("vae", "denoiser"):
        if getattr(app, key).steps < 1 or getattr(app, key).batch_size < 1 or getattr(app, key).learning_rate <= 0:
            raise UserError(f"{key}.steps, {key}.batch_size and {key}.learning_rate must be positive")
    if not 0 <= app.denoiser.empty_caption_rate < 1:
        raise UserError(f"denoiser.empty_caption_rate={app.denoiser.empty_caption_rate} is outside [0, 1)")
    if not 0 <= app.two_object_share <= 1:
        raise UserError(f"two_object_share={app.two_object_share} is outside [0, 1]")
    if app.dataset_size < 1 or app.eval_prompts < 0 or app.eval_steps < 1:
        raise UserError("dataset_size and eval_steps must be positive and eval_prompts not negative")


def validate_image_size(sizes: dict, prefix: str, multiple: int = 1, why: str = "the model's VAE scale factor") -> None:
    """Refuses an image size the model cannot make. diffusers' rule: a positive multiple of the VAE's
    scale factor (8 for SD, SDXL and Flux), since each latent pixel decodes to that many pixels a
    side, times a DiT's patch size (Flux: 2, so 16); the workflows check it once they know the
    model (1 checks only that it is positive). The UNet takes any latent size: where the latent is
    no multiple of 2**(its upsampling layers), diffusers upsamples to the size of the matching skip
    connection, and the export traces that path (export._upsampling_to_skip_sizes)."""
    for key in ("width", "height"):
        value = sizes[key]
        if value is not None and (value < multiple or value % multiple):
            rule = f"a positive multiple of {multiple}, {why}" if multiple > 1 else "positive"
            raise UserError(f"{prefix}{key}={value} must be {rule}")


def sizes_of(block) -> dict:
    """A block's height and width, as validate_image_size takes them."""
    return {"height": block.height, "width": block.width}


def validate_steps(steps: int, key: str, scheduler_config) -> None:
    """Refuses more denoising steps than the scheduler has training timesteps: diffusers' schedulers
    would fail at the last step, after the whole loop."""
    train_steps = scheduler_config.get("num_train_timesteps", 1000)
    if steps > train_steps:
        raise UserError(f"{key}={steps} is more than the scheduler's {train_steps} training timesteps: "
                        f"choose at most {train_steps}")


def validate_sampling(sampling: SamplingBlock) -> None:
    validate_image_size(sizes_of(sampling), "sampling.")
    if sampling.steps < 1:
        raise UserError(f"sampling.steps={sampling.steps} must be at least 1")
    if sampling.batch_size < 1:
        raise UserError(f"sampling.batch_size={sampling.batch_size} must be at least 1")
    if sampling.num_images_per_prompt < 1:
        raise UserError(f"sampling.num_images_per_prompt={sampling.num_images_per_prompt} must be at least 1")
    if sampling.long_prompts not in LONG_PROMPTS:
        raise UserError(f"sampling.long_prompts={sampling.long_prompts!r} is unknown: choose "
                        f"{' or '.join(LONG_PROMPTS)}")
    if sampling.cache.method not in CACHE_METHODS:
        raise UserError(f"sampling.cache.method={sampling.cache.method!r} is unknown: choose "
                        f"{' or '.join(CACHE_METHODS)}")


def validate_serve(block: ServeBlock) -> None:
    """serve.* alone, before Ray starts; each refusal names its key."""
    if not block.host:
        raise UserError("serve.host is empty: give 127.0.0.1 (this machine alone) or an address to listen on")
    if not 1 <= block.port <= 65535:
        raise UserError(f"serve.port={block.port} must be from 1 to 65535")
    for key in ("num_replicas", "max_batch_size", "max_images_per_request", "max_steps", "max_prompt_chars",
                "kept_video_jobs"):
        if getattr(block, key) < 1:
            raise UserError(f"serve.{key}={getattr(block, key)} must be at least 1")
    for key in ("gpus_per_replica", "cpus_per_replica", "batch_wait_timeout_s", "max_queued_requests",
                "drain_timeout_s"):
        value = getattr(block, key)
        if value is not None and value < 0:
            raise UserError(f"serve.{key}={value} must be 0 or more")
    if any(not 1 <= size <= block.max_batch_size for size in block.warm_batches):
        raise UserError(f"serve.warm_batches={list(block.warm_batches)}: each must be from 1 to serve.max_batch_size="
                        f"{block.max_batch_size}")
    if block.max_images_per_request > block.max_batch_size:
        raise UserError(f"serve.max_images_per_request={block.max_images_per_request} is more than one call draws "
                        f"(serve.max_batch_size={block.max_batch_size}): lower it, or raise max_batch_size")
    if block.max_body_bytes < 1024:
        raise UserError(f"serve.max_body_bytes={block.max_body_bytes} leaves no room for a request: give 1024 or more")
    if block.api_key is not None and not block.api_key.strip():
        raise UserError("serve.api_key is empty: give a key, or null for none")
    if block.api_key and block.api_key_env:
        raise UserError("serve.api_key and serve.api_key_env both give a key: keep one")
    if block.api_key_env and not os.environ.get(block.api_key_env, "").strip():
        raise UserError(f"serve.api_key_env={block.api_key_env} names an environment variable that is not set or "
                        "empty: export it with the key, or set serve.api_key_env=null")


def serve_api_key(block: ServeBlock) -> str | None:
    """The key /v1 requests must give (serve.api_key, else the variable serve.api_key_env names);
    None: none."""
    return block.api_key or (os.environ[block.api_key_env].strip() if block.api_key_env else None)
