"""Wan2.2 on its full-size architectures (random bf16 weights): an expert call at the video's
geometry, ours against diffusers' own compiled transformer, a whole video through infer_trt.py's
torch backend, the VAE decode, and one video over several GPUs. Each variant runs in a process of
its own (peak memory and compiled code its own); rows go to --out with the device's name. Needs
CUDA GPUs; --tiny runs the same code on the tiny
architectures, on the CPU where no GPU is, as a dry run.

Expert calls (Wan2.2-T2V-A14B at MLPerf's 720x1280, 81 frames: 75,600 tokens a call; --model
wan_ti2v: Wan2.2-TI2V-5B at 704x1280, 121 frames):
    python benchmarks/wan_full_size.py --variants peer,compiled,fp8,fp8_l4 --out benchmarks/results/wan_h100.json

- peer: diffusers' WanTransformer3DModel compiled as its documentation advises
  (torch.compile(transformer, fullgraph=True), default mode), called as WanPipeline calls it, the
  conditional and the unconditional halves one after the other: one step is two calls of one video
  (--attention-kernel flash3: under diffusers' FlashAttention-3 backend, set_attention_backend).
- compiled: our torch backend's expert stage in bf16 (the family's projections, sigmoid GELU;
  compiled, default mode), run as the torch backend runs it: the halves one after the other, as
  the peer's (--one-call: both as one batch of two), with torch_backend.attention_kernel's kernels
  (--attention-kernel, auto by default: FlashAttention-3 where installed).
- fp8 / fp8_l4: the same with quantize.py's FP8 recipe at level 3 (FP8 Linear) or 4 (+ cuDNN's FP8
  self-attention): the whole pipeline (UMT5, both experts, the VAE) is built, both experts are
  calibrated by quantize.py's own calibration (two steps of one prompt at 256x448 and 5 frames, so
  each expert serves one: the kernels' speed does not depend on the ranges) and turned into FP8
  kernels, so the row also holds what both FP8 experts, UMT5 and the VAE keep resident on one GPU,
  and each component's weights in bf16 and after the conversion. --every-block quantizes the six
  blocks the recipe keeps in 16 bits as well: what FP8 can give on the GPU, not a recipe.
--profile adds the GPU time per kernel of one call (ours and the peer's).

A whole video (--whole; ours): 20 steps of MLPerf's settings (guidance 4.0 / 3.0, boundary 0.875)
through the torch backend's pipeline (UMT5, each step's expert, the VAE in fp32), after a warm-up
video that compiles all it runs (the row counts the graphs compiled while timed, 0 when warm): the
same video, or --warm-steps steps of it where what compiles does not depend on the step count (no
cache hook, or ours, whose TaylorSeer update runs outside the graphs; diffusers' own, as the peer
runs it, compiles again at each full pass); the VAE decodes eagerly there (its 81-frame compile
is timed in the vae variant). --cache taylorseer:<n> / taylorseer_blocks:<n> (:<w>: w full passes an expert before
the first prediction, 3 unless given; :<backbone>=<n>,... after it: those experts every n steps) /
first_block:<threshold> runs it under
a diffusers cache hook (first_block_steps:<backbone>=<step>/<step>/...,...: ours on a fixed schedule,
the steps each expert runs in full, the rest skipped: a video's time at a share of full calls that
random weights cannot decide by a threshold; its warm-up needs a skipped step of each expert);
--window <frames>[:<backbone>,...] runs ours with self-attention within that many latent frames
(torch_backend.attention_window), with --window-heads <fraction> for that share of each layer's heads alone (the first of each, in a heads file written for the run: random weights
have no local heads to record, and the speed depends on how many, not which); --mlperf <n> runs
LoadGen's Offline over n prompts (--mlperf-prompts; the package's evaluation prompts unless given)
instead of one timed video (benchmarks/mlperf_video.py: GPU-seconds a video). The peer's whole
video (--variants peer --whole) is what a user runs instead: diffusers' WanPipeline called with the
same settings, each expert compiled as the peer's expert call (fullgraph=False under --cache, whose
hook breaks the graph), under the same cache hook, the VAE in fp32 and eager as ours.
    python benchmarks/wan_full_size.py --variants fp8_l4 --whole --out benchmarks/results/wan_video_h100.json
    python benchmarks/wan_full_size.py --variants peer --whole --cache taylorseer_blocks:2:1 --out ...

The VAE (variant vae): one decode of the video's latent in fp32 and in bf16, eager, then compiled
in bf16, each with its time and peak.

Several GPUs (torchrun; ours): --split <cfg>x<ulysses> shares each call among cfg x ulysses
processes (parallel.cfg, parallel.ulysses as infer_trt.py does them): each process first computes
the call eagerly whole and split, and the row gives their largest difference; then the split call is
compiled and timed, both with the attention kernels infer_trt.py gives a split call (--attention-kernel,
auto: FlashAttention-3 where installed, except in diffusers' own processors that context
parallelism splits, which keep torch's). --split 1x1 on N processes: each process times its own
whole calls side by side (data parallel).
    torchrun --nproc_per_node=4 benchmarks/wan_full_size.py --variants fp8_l4 --split 2x2 --out ...
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import dataclasses
import json
import math
import re
import tempfile
import time
from pathlib import Path

import torch

from sdquant import parallel, report
from sdquant.api import from_pipeline
from sdquant.parallel import batch_parts
from sdquant.config import TORCH_ATTENTION_KERNELS, QuantizeBlock, TorchBackendBlock
from sdquant.families.base import built_in, full_size_on_gpu
from sdquant.families.wan import WAN, WAN_TI2V
from sdquant.families.wan.family import BLOCK_STACKS
from sdquant.families.wan.flow import TEMPORAL_SCALE, latent_frames, latent_tokens
from sdquant.families.wan.graphs import Umt5Graph, VideoDecoderGraph
from sdquant.families.wan.sizes import expert
from sdquant.load import quiet_libraries
from sdquant.quantize.calibrate import quantize_backbones
from sdquant.runtime import torch_backend
from sdquant.runtime.attention import chosen_kernel, use_attention_kernel
from sdquant.runtime.cache_hooks import HookCache, allow_recompiles
from sdquant.runtime.compiled_forms import use_persistent_rows
from harness.caches import SAYS as CACHE_SAYS, SETTING as CACHE_SETTING, cache_block, hook_cache
from harness.measure import graphs_compiled, kernel_profile, nonfinite_values, time_calls, timed
from harness.peers import peer_attention
from harness.processes import one_process_each, record_variant

PROMPT = "a red fox running through fresh snow in a pine forest at dawn, cinematic"
FAMILIES = {"wan": WAN, "wan_ti2v": WAN_TI2V}
# MLPerf's text-to-video settings for the A14B; the TI2V-5B's own (its model card's 50 steps, guidance 5).
SETTINGS = {"wan": {"steps": 20, "guidance": 4.0, "guidance_2": 3.0}, "wan_ti2v": {"steps": 50, "guidance": 5.0,
                                                                                   "guidance_2": None}}
# The FP8 variants' quant levels.
FP8_LEVELS = {"fp8": 3.0, "fp8_l4": 4.0}
# Calibration's geometry: small, a multiple of both models' 32-pixel grid.
CALIBRATION_FRAMES, CALIBRATION_SIZE = 5, (256, 448)
# The tiny dry run's geometry.
TINY_GEOMETRY = (9, 64, 64)
# Kernels a profile lists, the largest first (enough for ours and the peer's to be laid side by side).
PROFILE_ROWS = 40


def run_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_gib(reset: bool = False) -> float:
    if not torch.cuda.is_available():
        return 0.0
    peak = torch.cuda.max_memory_allocated() / 2**30
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return peak


def geometry(args, family) -> tuple[int, int, int]:
    """The video's frames, height and width."""
    return TINY_GEOMETRY if args.tiny else (family.default_frames, *family.default_size)


def sizes(args, family):
    return family.sizes["tiny" if args.tiny else "full"]


def one_expert(family, args, device: torch.device) -> torch.nn.Module:
    """One expert of the architecture in bf16, made on `device` (both of the A14B's are alike)."""
    return built_in(torch.bfloat16, device, lambda: expert(sizes(args, family))).eval()


def whole_pipeline(family, args, device: torch.device):
    return full_size_on_gpu(family, "tiny" if args.tiny else "full", device.type)


def resident_gib(device: torch.device) -> float:
    return torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else 0.0


def weights_gib(modules: dict) -> dict[str, float]:
    """Each module's weights, in GiB, as they are now."""
    return {name: sum(p.numel() * p.element_size() for p in module.parameters()) / 2**30
            for name, module in modules.items()}


def expert_inputs(family, module, args, batch: int, device: torch.device, dtype: torch.dtype) -> dict:
    """One expert call's inputs at the video's geometry: `batch` samples of noise, the timestep (one
    per latent token where the family expands it) and UMT5-sized text states."""
    frames, height, width = geometry(args, family)
    scale = family.vae_scale(dict(sizes(args, family).vae))
    shape = (latent_frames(frames, TEMPORAL_SCALE), height // scale, width // scale)
    generator = torch.Generator(device).manual_seed(0)
    tokens = latent_tokens(*shape)
    timestep = torch.full((batch, tokens) if family.expand_timesteps else (batch,), 500.0, device=device)
    return {"hidden_states": torch.randn(batch, module.config.in_channels, *shape, generator=generator,
                                         device=device).to(dtype),
            "timestep": timestep,
            "encoder_hidden_states": torch.randn(batch, sizes(args, family).text_tokens, module.config.text_dim,
                                                 generator=generator, device=device).to(dtype)}


def quantize_every_block(family) -> None:
    """Drop the blocks the recipe keeps in 16 bits (ModelOpt's Wan filter) from the family's high
    precision: a measurement of what FP8 can give on this GPU, not a recipe (its quality is not
    measured)."""
    family.level_table = dataclasses.replace(family.level_table, high_precision_blocks=())


def calibrated_pipeline(family, args, level: float, device: torch.device):
    """The whole pipeline on `device` with both experts calibrated by quantize.py's calibration at
    `level` (fake-quantized in memory: our_pipeline turns them into FP8 kernels)."""
    if args.every_block:
        quantize_every_block(family)
    pipe = whole_pipeline(family, args, device)
    bf16 = weights_gib({name: getattr(pipe, name) for name in family.components})
    height, width = CALIBRATION_SIZE if not args.tiny else TINY_GEOMETRY[1:]
    block = QuantizeBlock(format="fp8", quant_level=level, n_steps=2, calib_size=1, batch_size=1, height=height,
                          width=width, guidance_scale=4.0, num_frames=CALIBRATION_FRAMES)
    quantize_backbones(pipe, family, [PROMPT], block, seed=0, cuda_graph=False,
                       call_kwargs=family.calibration_call_kwargs(block))
    return pipe, {"bf16_weights_gib": bf16}


def our_pipeline(pipe, variant: str, family, args, cache: dict | None = None):
    """`pipe` built into our pipeline as infer_trt.py builds it (sdquant.api.from_pipeline): compiled,
    with torch_backend.attention_kernel's kernels; an FP8 variant's experts on FP8 kernels. The row
    gets each component's weights after the conversion and what it turned."""
    level = FP8_LEVELS.get(variant)
    frames, height, width = geometry(args, family)
    pipeline = from_pipeline(pipe, family.name, None if level is None else ("fp8", level),
                             torch_backend={"compile": True, "attention_kernel": args.attention_kernel,
                                            "attention_window": attention_window(args.window, args.window_heads,
                                                                                 heads_file_of(pipe, family, args)),
                                            **({"quantized": "fp8"} if level else {})},
                             sampling={"scheduler": "unipc", "num_frames": frames, "height": height, "width": width,
                                       **({"cache": cache} if cache else {})})
    conversions = pipeline.conversions.values()
    record = {"fp8_layers": sum(each.layers for each in conversions),
              "fp8_attention_layers": sum(each.attention for each in conversions)}
    if level is not None:
        record["fp8_weights_gib"] = weights_gib({name: getattr(pipe, name) for name in family.components})
    return pipeline, record


def attention_window(option: str, heads: float = 0, heads_file: str | None = None) -> dict:
    """--window <frames>[:<backbone>,...] as torch_backend.attention_window ('': none); with
    --window-heads, the heads file that windows the heads marked 1 in it."""
    if not option:
        return {}
    frames, _, backbones = option.partition(":")
    return {"frames": int(frames), **({"backbones": backbones.split(",")} if backbones else {}),
            **({"heads_file": heads_file, "min_share": 0.5} if heads else {})}


def heads_file_of(pipe, family, args) -> str | None:
    """For --window-heads f: a heads file whose shares are 1 for the first ceil(f x heads) heads of
    each frame self-attention layer and 0 for the others."""
    if not args.window_heads:
        return None
    frames = int(args.window.partition(":")[0])
    backbones = {}
    for attribute in family.backbone_attributes:
        module = getattr(pipe, attribute, None)
        if module is None:
            continue
        backbones[attribute] = {str(index): [1.0 if head < math.ceil(args.window_heads * attn.heads) else 0.0
                                             for head in range(attn.heads)]
                                for index, attn in family.frame_attention_layers(module).items()}
    path = Path(tempfile.mkdtemp()) / "heads.json"
    path.write_text(json.dumps({"frames": frames, "backbones": backbones}))
    return str(path)


def umt5_seconds(pipe, family, args, device: torch.device) -> float:
    """One UMT5 call over a video's prompt and negative prompt, eager, as the pipeline runs it."""
    ids = torch.ones(2, sizes(args, family).text_tokens, dtype=torch.int32, device=device)
    with torch.no_grad():
        return time_call(lambda: Umt5Graph(pipe.text_encoder)(ids, ids), 1)["best_call_s"]


def time_call(call, calls: int) -> dict:
    """The first call (where it compiles), then `calls` more, each synchronized, and the peak of
    those."""
    peak_gib(reset=True)
    row = time_calls(call, calls)
    return {"first_call_s": row["first_call_s"], "call_s": row["end_to_end_s"], "best_call_s": row["best_s"],
            "call_peak_gib": peak_gib(), "graphs_compiled_while_timed": row["graphs_compiled_while_timed"],
            "nonfinite_values": row["nonfinite_values"]}


def peer_row(family, args, device: torch.device) -> dict:
    """diffusers' transformer compiled as its documentation advises, the two guidance halves called
    one after the other as WanPipeline calls them."""
    module = one_expert(family, args, device)
    resident = weights_gib({"expert": module})["expert"]
    kernel = peer_attention([module], args.attention_kernel, device)
    compiled = torch.compile(module, fullgraph=True)
    halves = batch_parts(expert_inputs(family, module, args, 2, device, torch.bfloat16), 2)

    def step():
        return torch.cat([compiled(**half, return_dict=False)[0] for half in halves])

    with torch.no_grad():
        row = time_call(step, args.calls)
        if args.profile and device.type == "cuda":
            row["call_profile"] = kernel_profile(step, top=PROFILE_ROWS)
    return {**row, "step_s": row["best_call_s"], "one_expert_weights_gib": resident,
            "attention_kernel": kernel,
            "compile": "torch.compile(transformer, fullgraph=True), default mode; two calls of one video a step"}


def ours_row(variant: str, family, args, device: torch.device) -> dict:
    """Our first expert's stage as the pipeline runs it (sdquant.api.from_pipeline: bf16 compiled, or
    FP8 with fp8 and fp8_l4), with the whole pipeline resident: one step's calls of both halves."""
    if variant in FP8_LEVELS:
        pipe, record = calibrated_pipeline(family, args, FP8_LEVELS[variant], device)
    else:
        pipe, record = whole_pipeline(family, args, device), {}
    pipeline, converted = our_pipeline(pipe, variant, family, args)
    record.update(converted, pipeline_resident_gib=resident_gib(device),
                  umt5_s=umt5_seconds(pipe, family, args, device),
                  attention_kernel=chosen_kernel(args.attention_kernel, device))
    module = getattr(pipe, family.backbones[0].attribute)
    stage = pipeline.stages[family.backbones[0].graph]
    if args.one_call:
        stage.size = None
    inputs = expert_inputs(family, module, args, 2, device, torch.bfloat16)

    def step():
        return stage(**inputs)["latent"]
    with torch.no_grad():
        row = time_call(step, args.calls)
        # GPU kernels only: on the CPU (the --tiny dry run) the row says so instead.
        if args.profile and device.type == "cuda":
            row["call_profile"] = kernel_profile(step, top=PROFILE_ROWS)
        elif args.profile:
            row["call_profile"] = "not on the CPU: the profile times GPU kernels"
    return {**record, **row, "step_s": row["best_call_s"]}


def whole_video_row(variant: str, family, args, device: torch.device) -> dict:
    """One whole video through the pipeline as infer_trt.py builds it, after the same video as a
    warm-up; the stages' times from the timed call."""
    cache = cache_block(args.cache)
    if variant in FP8_LEVELS:
        pipe, record = calibrated_pipeline(family, args, FP8_LEVELS[variant], device)
    else:
        pipe, record = whole_pipeline(family, args, device), {}
    # from_pipeline decodes in fp32, as infer_trt.py loads the Wan VAE (family.decoder_dtype).
    pipeline, converted = our_pipeline(pipe, variant, family, args, cache)
    record.update(converted, pipeline_resident_gib=resident_gib(device))
    frames, height, width = geometry(args, family)
    chosen = SETTINGS[family.name]

    def settled(steps: int):
        return pipeline.settle([PROMPT], steps=steps, guidance_scale=chosen["guidance"],
                               guidance_scale_2=chosen["guidance_2"], height=height, width=width, num_frames=frames,
                               seed=42)

    settings = settled(args.steps or chosen["steps"])
    if args.mlperf:
        return {**record, **mlperf_offline(pipeline, settings, args), "steps": settings.steps,
                "cache": settings.cache.describe() if settings.cache else None}
    warm_settings = settled(args.warm_steps) if args.warm_steps else settings
    drawn = []
    row = warm_then_timed(lambda: pipeline.run(warm_settings, progress=False).samples,
                          lambda: drawn.append(pipeline.run(settings, progress=False)) or drawn[-1].samples)
    stage = report.latency_report([(row["video_s"], drawn[-1].stage_seconds)], 1, settings.steps,
                                  [backbone.graph for backbone in family.backbones])
    # Each call's time apart, so that a cached video shows what a predicted step costs beside a full pass.
    call_ms = {name: [round(seconds * 1000, 1) for seconds in calls] for name, calls in drawn[-1].stage_seconds.items()}
    return {**record, **row, "ms": stage["ms"], "stage_ms": stage["stage_ms"], "stage_calls": stage["stage_calls"],
            "stage_call_ms": call_ms, "steps": settings.steps, "warm_up_steps": warm_settings.steps,
            "cache": settings.cache.describe() if settings.cache else None, "cache_passes": drawn[-1].cache_passes}


def mlperf_offline(pipeline, settings, args) -> dict:
    """LoadGen's Offline over the first --mlperf prompts of --mlperf-prompts at `settings`' steps,
    guidance and geometry, every video from one latent, after a warm-up video (of --warm-steps
    steps where given; benchmarks/mlperf_video.py's run)."""
    from mlperf_video import first_prompts, measured

    prompts = first_prompts(args.mlperf_prompts, args.mlperf, "--mlperf")
    options = argparse.Namespace(seed=42, latent=None, scenario="offline", min_duration_s=0.0, expected_video_s=None)
    geometry = settings.geometry
    run = measured(options, pipeline, prompts, steps=settings.steps, guidance_scale=settings.guidance_scale,
                   guidance_scale_2=settings.guidance_scale_2, height=geometry.height, width=geometry.width,
                   num_frames=geometry.frames, warm_up_steps=args.warm_steps)
    return {**run, "video_s": run["gpu_s_per_video"], "prompts_file": str(args.mlperf_prompts)}


def warm_then_timed(warm_up, video) -> dict:
    """The warm-up video's seconds (`warm_up`: one that runs everything the timed one runs, so that
    it is compiled first: under a cache hook, its predicted steps and, where the compile
    specializes on the hook's step counter, every step), then one timed `video()`: its seconds,
    peak, non-finite values and the graphs dynamo compiled during it (0 where the warm-up covered
    it all)."""
    with torch.no_grad():
        warm_s = timed(warm_up, 1)[0]
        graphs = graphs_compiled()
        peak_gib(reset=True)
        start = time.perf_counter()
        output = video()
        synchronize()
        seconds = time.perf_counter() - start
    return {"warm_up_video_s": warm_s, "video_s": seconds, "videos_per_s": 1 / seconds,
            "video_peak_gib": peak_gib(), "nonfinite_values": nonfinite_values(output),
            "graphs_compiled_while_timed": graphs_compiled() - graphs}


def peer_video_row(family, args, device: torch.device) -> dict:
    """One whole video through diffusers' WanPipeline as a user speeds it up, after the same video
    as a warm-up. WanPipeline resets each transformer's cache hooks at the end of every call
    (maybe_free_model_hooks), so the timed video's hooks start afresh."""
    cache = hook_cache(args.cache, BLOCK_STACKS)
    pipe = whole_pipeline(family, args, device)
    # fp32 as ours: WanPipeline casts the final latents to the VAE's dtype and decodes eagerly.
    pipe.vae.to(torch.float32)
    record = {"pipeline_resident_gib": resident_gib(device), "boundary_ratio": pipe.config.boundary_ratio,
              **compile_peer_experts(pipe, args, cache, device)}
    frames, height, width = geometry(args, family)
    chosen = SETTINGS[family.name]
    steps = args.steps or chosen["steps"]

    def video(steps: int = steps) -> torch.Tensor:
        return pipe(prompt=PROMPT, negative_prompt="", height=height, width=width, num_frames=frames,
                    num_inference_steps=steps, guidance_scale=chosen["guidance"],
                    guidance_scale_2=chosen["guidance_2"], generator=torch.Generator(device).manual_seed(42),
                    output_type="pt").frames

    warm_up = (lambda: video(args.warm_steps)) if args.warm_steps else video
    return {**record, **warm_then_timed(warm_up, video), "steps": steps, "warm_up_steps": args.warm_steps or steps,
            "cache": cache.describe() if cache else None}


def compile_peer_experts(pipe, args, cache: HookCache | None, device: torch.device) -> dict:
    """Each of `pipe`'s experts (transformer_2 is None for the TI2V-5B) compiled as peer_row compiles
    one, under `cache`'s diffusers hook where given; what the row records of it."""
    experts = [name for name in ("transformer", "transformer_2") if getattr(pipe, name) is not None]
    kernel = peer_attention([getattr(pipe, name) for name in experts], args.attention_kernel, device)
    for name in experts:
        module = getattr(pipe, name)
        if cache is not None:
            # The hook and the recompile limits as our stages have them: with the graph broken at
            # each hooked block, past dynamo's limit the remaining blocks would silently run eager.
            module.enable_cache(cache.for_backbone(name).config(module))
            allow_recompiles(module)
        # The hook decides on the host: fullgraph=True would refuse its graph breaks.
        setattr(pipe, name, torch.compile(module, fullgraph=cache is None))
    how = "fullgraph=True" if cache is None else "fullgraph=False (the cache hook breaks the graph), recompile limits raised"
    return {"attention_kernel": kernel,
            "compile": f"torch.compile(each expert, {how}), default mode; WanPipeline's two calls of one video a "
                       "step; the VAE in fp32, eager"}


def vae_row(family, args, device: torch.device) -> dict:
    """One decode of the video's latent: eager fp32 and bf16, then compiled bf16."""
    from diffusers import AutoencoderKLWan

    vae = built_in(torch.float32, device, lambda: AutoencoderKLWan(**dict(sizes(args, family).vae))).eval()
    frames, height, width = geometry(args, family)
    scale = family.vae_scale(dict(vae.config))
    latent = torch.randn(1, vae.config.z_dim, latent_frames(frames, TEMPORAL_SCALE), height // scale, width // scale, device=device)
    graph = VideoDecoderGraph(vae)
    row = {}
    with torch.no_grad():
        for name, dtype, compiled in (("fp32", torch.float32, False), ("bf16", torch.bfloat16, False),
                                      ("bf16_compiled", torch.bfloat16, True)):
            vae.to(dtype)
            call = torch.compile(graph) if compiled else graph
            row[name] = time_call(lambda: call(latent.to(dtype)), 1)
            # So far, in the log: the compiled decode may outlast its lane.
            print(f"vae {name}: {json.dumps(row[name])}", flush=True)
    return {**row, "frames_decoded": frames}


def split_row(variant: str, family, args, device: torch.device, world: parallel.World) -> dict:
    """One expert call shared by each group of cfg x ulysses processes, or (1x1) each process's own
    call side by side with the others'."""
    cfg, ulysses = (int(part) for part in args.split.split("x"))
    split = parallel.SampleSplit(cfg, ulysses)
    place = parallel.place_of(split, world, device)
    if variant in FP8_LEVELS:
        pipe, record = calibrated_pipeline(family, args, FP8_LEVELS[variant], device)
        module = getattr(pipe, family.backbones[0].attribute)
        conversion = torch_backend.convert_quantized(module, family, f"the benchmark's {variant} expert", "fp8",
                                                     quant_level=FP8_LEVELS[variant])
        record.update(fp8_layers=conversion.layers, fp8_attention_layers=conversion.attention)
        # The rest of the pipeline (UMT5, the other expert) off the GPU: the eager whole call's
        # activations need the room.
        del pipe
        gc.collect()
        torch.cuda.empty_cache()
    else:
        module, record = one_expert(family, args, device), {}
    torch_backend.compiled_backbone_forms(module, family, quantized=variant in FP8_LEVELS)
    record["attention_kernel"] = chosen_kernel(args.attention_kernel, device)
    # The kernels infer_trt.py gives a split call, in the whole call too: the two then differ by the
    # split alone.
    use_attention_kernel(module, record["attention_kernel"], split_later=ulysses > 1)
    inputs = expert_inputs(family, module, args, 2, device, torch.bfloat16)
    stage = family.backbone_stages({backbone.attribute: module for backbone in family.backbones},
                                   torch.bfloat16)[family.backbones[0].graph]
    with torch.no_grad():
        if split.size > 1:
            whole = stage(**inputs)["latent"]
            parallel.split_by_sequence([module], place, ulysses)
            shared = parallel.split_guidance({"expert": stage}, ("expert",), place)["expert"]
            difference = (shared(**inputs)["latent"] - whole).abs().max().item()
            record.update(max_abs_difference_split_eager=difference, whole_max_abs=whole.abs().max().item())
        else:
            shared = stage
        use_persistent_rows()
        stage.graph = torch.compile(stage.graph, **torch_backend.compile_settings(TorchBackendBlock(compile=True)))
        row = time_call(lambda: shared(**inputs)["latent"], args.calls)
    rows = parallel.gather(row, world)
    return {**record, "split": {"cfg": cfg, "ulysses": ulysses, "processes": world.size},
            "step_s": max(r["best_call_s"] for r in rows), "per_process": rows}


def run_variant(variant: str, args) -> tuple[str, dict]:
    family = FAMILIES[args.model]
    world = parallel.current_world()
    device = parallel.rank_device(run_device(), world)
    parallel.start(world, device)
    torch.manual_seed(0)
    start = time.perf_counter()
    if args.split:
        row, name = split_row(variant, family, args, device, world), f"{variant}_split{args.split}_on{world.size}"
    elif variant == "vae":
        row, name = vae_row(family, args, device), variant
    elif args.whole:
        row = (peer_video_row(family, args, device) if variant == "peer"
               else whole_video_row(variant, family, args, device))
        name = f"{variant}_video" + (f"_{re.sub('[:=,/]', '_', args.cache)}" if args.cache else "") + (
            f"_mlperf{args.mlperf}" if args.mlperf else "")
    elif variant == "peer":
        row, name = peer_row(family, args, device), variant
    else:
        row, name = ours_row(variant, family, args, device), variant
    if args.attention_kernel != "auto":
        name += f"_{args.attention_kernel}"
    if args.every_block:
        name += "_every_block"
    if args.window:
        name += "_window" + re.sub(r"[:,]", "_", args.window)
    if args.window_heads:
        name += f"_heads{round(args.window_heads * 100)}"
    if args.one_call:
        name += "_one_call"
    row["wall_s"] = time.perf_counter() - start
    if world.is_main:
        print(f"{name}: {json.dumps({k: v for k, v in row.items() if not isinstance(v, (list, dict))})}", flush=True)
    return name, row


def refused_prompts(parser, args) -> None:
    """--mlperf's prompts read before any model is built: a missing file, or fewer prompts than
    asked, stop the run in one line; without --mlperf-prompts, the package's evaluation prompts."""
    from mlperf_video import first_prompts

    from sdquant.errors import UserError
    from sdquant.load import builtin_prompts_path

    args.mlperf_prompts = args.mlperf_prompts or builtin_prompts_path("eval_prompts.txt")
    if not args.mlperf_prompts.is_file():
        parser.error(f"--mlperf-prompts {args.mlperf_prompts}: no such file")
    try:
        first_prompts(args.mlperf_prompts, args.mlperf, "--mlperf")
    except UserError as error:
        parser.error(f"{error}: give --mlperf-prompts with as many")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="peer,compiled,fp8_l4",
                        help=f"comma-separated: peer, compiled, {', '.join(FP8_LEVELS)}, vae")
    parser.add_argument("--model", default="wan", choices=sorted(FAMILIES))
    parser.add_argument("--calls", type=int, default=2, help="timed calls after the first")
    parser.add_argument("--whole", action="store_true",
                        help="a whole video through our pipeline (peer: through diffusers' WanPipeline)")
    parser.add_argument("--steps", type=int, default=0, help="--whole: steps (0: the model's settings)")
    parser.add_argument("--warm-steps", type=int, default=0,
                        help="--whole: the warm-up video's steps (0: the timed video's). Fewer where nothing compiled "
                             "depends on the step count (the row's graphs_compiled_while_timed says whether it did)")
    parser.add_argument("--mlperf", type=int, default=0,
                        help="--whole, ours: LoadGen's Offline over this many prompts, each a video from one latent "
                             "(benchmarks/mlperf_video.py's run), instead of one timed video")
    parser.add_argument("--mlperf-prompts", type=Path,
                        help="--mlperf's prompts, one a line (MLPerf's data/vbench_prompts.txt); default: the "
                             "package's evaluation prompts")
    parser.add_argument("--cache", default="", help=f"--whole: {CACHE_SAYS}")
    parser.add_argument("--split", default="", help="under torchrun: <cfg>x<ulysses> (1x1: data parallel)")
    parser.add_argument("--profile", action="store_true", help="ours and the peer: GPU time per kernel of one call")
    parser.add_argument("--one-call", action="store_true",
                        help="ours: both guidance halves as one call of two samples a step, not the torch backend's two")
    parser.add_argument("--attention-kernel", default="auto", choices=TORCH_ATTENTION_KERNELS,
                        help="ours: torch_backend.attention_kernel; peer: flash3 runs diffusers' FlashAttention-3 backend")
    parser.add_argument("--every-block", action="store_true",
                        help="fp8 variants: quantize the blocks the recipe keeps in 16 bits too "
                             "(quantize.high_precision_blocks=[])")
    parser.add_argument("--window", default="",
                        help="ours: <frames>[:<backbone>,...], self-attention within that many latent frames "
                             "(torch_backend.attention_window)")
    parser.add_argument("--window-heads", type=float, default=0,
                        help="with --window: the share of each layer's heads that attends within it (0: all)")
    parser.add_argument("--tiny", action="store_true", help="the tiny architectures (a dry run, CPU or GPU)")
    parser.add_argument("--variant-timeout", type=float, default=0,
                        help="with several variants, seconds after which a variant's process is stopped (0: none)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in ("peer", "compiled", "vae", *FP8_LEVELS)]
    if unknown:
        parser.error(f"unknown variants {unknown}")
    if args.split and any(v in ("peer", "vae") for v in variants):
        parser.error("--split runs our variants (compiled, fp8, fp8_l4), not peer or vae")
    if args.mlperf and importlib.util.find_spec("mlperf_loadgen") is None:
        parser.error("--mlperf: MLPerf's LoadGen is not installed: pip install -e \".[serve-load]\" (mlcommons-loadgen)")
    if args.mlperf and (not args.whole or args.mlperf < 0 or "peer" in variants):
        parser.error(f"--mlperf {args.mlperf}: a number of prompts (1 or more) for --whole's videos of ours "
                     "(compiled, fp8, fp8_l4)")
    if args.mlperf:
        refused_prompts(parser, args)
    if args.warm_steps and not args.whole or args.warm_steps < 0:
        parser.error(f"--warm-steps {args.warm_steps}: a number of steps (1 or more) for --whole's warm-up video")
    if args.whole and "vae" in variants:
        parser.error("--whole runs a whole video (compiled, fp8, fp8_l4, peer), not vae")
    if args.split and not re.fullmatch(r"[12]x\d+", args.split):
        parser.error(f"--split {args.split}: give <cfg>x<ulysses>, cfg 1 or 2 (2x2, 1x1)")
    if args.one_call and (args.split or args.whole or "peer" in variants or "vae" in variants):
        parser.error("--one-call times our expert calls (compiled, fp8, fp8_l4), without --split or --whole")
    if args.every_block and not all(v in FP8_LEVELS for v in variants):
        parser.error(f"--every-block quantizes more blocks: give only {', '.join(FP8_LEVELS)}")
    if args.window and (not re.fullmatch(r"[1-9]\d*(:\w+(,\w+)*)?", args.window) or args.split
                        or "peer" in variants or "vae" in variants):
        parser.error(f"--window {args.window}: give <frames>[:<backbone>,...] (3, 3:transformer_2) for our variants "
                     "(compiled, fp8, fp8_l4), without --split")
    if args.window_heads and (not args.window or not 0 < args.window_heads < 1):
        parser.error(f"--window-heads {args.window_heads}: give a share of the heads in (0, 1) with --window")
    if args.cache and not re.fullmatch(CACHE_SETTING, args.cache):
        parser.error(f"--cache {args.cache}: give {CACHE_SAYS}")
    if args.cache.startswith("first_block_steps") and "peer" in variants:
        parser.error(f"--cache {args.cache}: a fixed schedule runs on our stages; diffusers' pipeline decides by a "
                     "threshold (first_block:<threshold>)")
    if one_process_each(args, variants):
        return
    quiet_libraries()
    world = parallel.current_world()
    results = json.loads(args.out.read_text()) if args.out.is_file() else {
        "benchmark": "wan_full_size", "model": args.model, "tiny": args.tiny,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "versions": report.library_versions(), "geometry": geometry(args, FAMILIES[args.model]), "variants": {}}
    if world.is_main:
        record_variant(results, args.out, variants[0], lambda: run_variant(variants[0], args))
        print(f"wrote {args.out}")
    else:
        run_variant(variants[0], args)
    parallel.stop(world)


if __name__ == "__main__":
    main()
