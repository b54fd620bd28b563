"""infer_trt.py's torch backend on the full-size Flux.1-dev architecture (random bf16 weights,
1024x1024, 28 steps, guidance 3.5, one image) against diffusers' own compiled FluxPipeline, each
variant in its own process (so peak memory is its own): the peers (harness.peers.PEERS:
the peer, peer_cudagraphs in mode="reduce-overhead", peer_autotune, and the peer with torchao's
dynamic FP8 per row or per tensor, torchao_row and torchao_tensor, where torchao is installed: the
`peers` extra), our compiled bf16 backend, our backend with FP8 GEMMs from this project's FP8
level-3 calibration (fp8), and the same at level 4 with every attention as cuDNN's FP8 attention
(fp8_l4; needs nvidia-cudnn-frontend). End to end, transformer per step, peak GPU memory, compile
time, non-finite values of the last image. Needs a CUDA GPU; each results file names its device.

    python benchmarks/flux_full_size.py --variants peer,peer_cudagraphs,torchao_row,torchao_tensor,fp8 \\
        --variant-timeout 540 --out benchmarks/results/flux_peers_h100.json
    python benchmarks/flux_full_size.py --variants peer --out benchmarks/results/flux_h100.json
    python benchmarks/flux_full_size.py --variants compiled --out benchmarks/results/flux_h100.json
    python benchmarks/flux_full_size.py --variants fp8 --out benchmarks/results/flux_h100.json
    python benchmarks/flux_full_size.py --variants fp8_l4 --out benchmarks/results/flux_h100.json
    python benchmarks/flux_full_size.py --variants fp8_l4 --per-step-modulations --out benchmarks/results/flux_h100.json
    python benchmarks/flux_full_size.py --variants fp8 --cache taylorseer:2 --out benchmarks/results/flux_h100.json
    python benchmarks/flux_full_size.py --variants fp8 --cache taylorseer_blocks:2 \
        --out benchmarks/results/flux_h100.json

The peer follows diffusers' speed advice for Flux: fused q/k/v projections and torch.compile of the
transformer with fullgraph=True and of the VAE decoder, in the default mode (the advised
max-autotune takes longer than the device's ten minutes a call). The torchao variants add, between
the fusion and the compilation, what diffusers-torchao runs for FP8 on Flux:
`quantize_(transformer, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))` (or
PerTensor()), compiled with torch's default settings (harness/peers.py says why not torchao's
set_inductor_config), and with activation_value_lb=1e-12 so that an all-zero row does not quantize to NaN (as in
torch_backend_full_size.py). The FP8 variant calibrates the
transformer with quantize.py's own calibration (sdquant.quantize.calibrate.quantize_backbones: format=fp8,
quant_level=3, two denoising steps of one prompt at 1024x1024; the GEMMs' speed does not depend on
the values) and runs it with torch_backend.quantized=fp8; fp8_l4 calibrates at quant_level=4. With
--cache, our variants run under one of diffusers' cache hooks (sampling.cache.method=taylorseer or
taylorseer_blocks with its interval, or first_block with its threshold): compiled, without CUDA
graphs, which a hook's host-side decisions rule out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from sdquant import report
from sdquant.api import from_pipeline
from sdquant.runtime import step_modulations
from sdquant.quantize.calibrate import quantize_backbones
from sdquant.config import QuantizeBlock
from sdquant.families.flux import family as flux
from sdquant.families.base import full_size_on_gpu
from sdquant.families.flux import FLUX
from sdquant.load import quiet_libraries
from harness.caches import cache_block, hook_cache
from harness.measure import graphs_compiled, kernel_profile, nonfinite_values, time_calls, timed
from harness.peers import (PEERS, add_attention_argument, add_compile_arguments, compile_peer, cudagraph_skips,
                           peer_attention, use_compile_arguments, variant_name)
from sdquant.runtime.attention import chosen_kernel
from harness.processes import add_process_arguments, one_process_each, record_variant

PROMPT = "a photo of an astronaut riding a horse on mars"
SIZE, STEPS, GUIDANCE = 1024, 28, 3.5
CUDA = torch.device("cuda")


def peer(pipe, runs: int, variant: str = "peer", tuned: bool = False, attention_kernel: str = "auto") -> dict:
    pipe.transformer.fuse_qkv_projections()
    kernel = peer_attention([pipe.transformer], attention_kernel, CUDA)
    setup = compile_peer(pipe, "transformer", variant, tuned)

    def call():
        return pipe(PROMPT, num_inference_steps=STEPS, guidance_scale=GUIDANCE, height=SIZE, width=SIZE,
                    output_type="pt", generator=torch.Generator("cuda").manual_seed(42)).images

    torch.cuda.reset_peak_memory_stats()
    return {**time_calls(call, runs), **setup, "cudagraph_skips": cudagraph_skips(), "attention_kernel": kernel,
            "inference_peak_gib": torch.cuda.max_memory_allocated() / 2**30}


# Our FP8 variants: the quant level each calibrates at.
FP8_LEVELS = {"fp8": 3.0, "fp8_l4": 4.0}


def fp8_transformer(pipe, family, level: float) -> None:
    """Calibrates the transformer in memory with quantize.py's own calibration at FP8 `level`."""
    block = QuantizeBlock(format="fp8", quant_level=level, n_steps=2, calib_size=1, batch_size=1, height=SIZE,
                          width=SIZE, guidance_scale=GUIDANCE)
    quantize_backbones(pipe, family, [PROMPT], block, seed=0, cuda_graph=False)


def build_variant(family, variant: str) -> tuple[object, dict]:
    """`family`'s full-size pipeline on the GPU, its transformer calibrated for an FP8 variant, and
    the set-up's figures for the results row: build time and the set-up's peak memory (building,
    calibrating), apart from what inference holds."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    pipe = full_size_on_gpu(family)
    build_s = time.perf_counter() - start
    if variant in FP8_LEVELS:
        fp8_transformer(pipe, family, FP8_LEVELS[variant])
    setup = {"build_s": build_s, "setup_peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    torch.cuda.empty_cache()
    return pipe, setup


def our_pipeline(pipe, family: str, variant: str, cache: dict | None = None, tuned: bool = False,
                 attention_kernel: str = "auto"):
    """`pipe` built into our pipeline as infer_trt.py builds it (sdquant.api.from_pipeline): compiled,
    with CUDA graphs unless a cache hook runs; an FP8 variant's transformer on FP8 kernels."""
    level = FP8_LEVELS.get(variant)
    return from_pipeline(pipe, family, None if level is None else ("fp8", level),
                         torch_backend={"compile": True, "tune_kernels": tuned, "attention_kernel": attention_kernel,
                                        **({"quantized": "fp8"} if level else {})},
                         cuda_graph=cache is None, sampling={"scheduler": "flow_euler", **({"cache": cache} if cache else {})})


def ours(pipe, variant: str, runs: int, cache: dict | None = None, profile: bool = False, tuned: bool = False,
         attention_kernel: str = "auto") -> dict:
    pipeline = our_pipeline(pipe, "flux", variant, cache, tuned, attention_kernel)
    settings = pipeline.settle([PROMPT], steps=STEPS, guidance_scale=GUIDANCE, height=SIZE, width=SIZE, seed=42)
    return {**time_one_image(pipeline, settings, runs, profile), **conversion_row(pipeline),
            "attention_kernel": chosen_kernel(attention_kernel, CUDA)}


def conversion_row(pipeline) -> dict:
    """What the row records of the backbones' conversion to FP8 kernels."""
    conversions = pipeline.conversions.values()
    return {"fp8_layers": sum(each.layers for each in conversions),
            "fp8_attention_layers": sum(each.attention for each in conversions)}


def time_one_image(pipeline, settings, runs: int, profile: bool = False) -> dict:
    """A DiT pipeline's first call, best of `runs` after warm-up, its stages and peak memory; with
    `profile`, the GPU time per kernel over one whole call (every step, the text encoders, the VAE)."""
    torch.cuda.reset_peak_memory_stats()
    first = timed(lambda: pipeline.run(settings, progress=False), 1)[0]
    pipeline.run(settings, progress=False)  # graph replays start with the third call
    graphs = graphs_compiled()
    seconds = timed(lambda: pipeline.run(settings, progress=False), runs)
    graphs = graphs_compiled() - graphs
    drawn = pipeline.run(settings, progress=False)
    stage = report.latency_report([(min(seconds), drawn.stage_seconds)], 1, settings.steps, ["transformer"])
    return {"first_call_s": first, "end_to_end_s": seconds, "best_s": min(seconds),
            "transformer_ms_per_step": stage["ms"]["backbone_per_step"], "vae_ms": stage["ms"]["vae"],
            "text_ms": stage["ms"]["text_encoders"], "graphs_compiled_while_timed": graphs,
            "inference_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "nonfinite_values": nonfinite_values(drawn.samples),
            **({"call_profile": kernel_profile(lambda: pipeline.run(settings, progress=False), top=20)}
               if profile else {})}


def run_variant(variant: str, args, cache: dict | None) -> tuple[str, dict]:
    """Builds, compiles and times one variant; its name (with the arguments' suffixes) and row."""
    start = time.perf_counter()
    pipe, setup = build_variant(FLUX, variant)
    if variant in PEERS:
        row = peer(pipe, args.runs, variant, tuned=args.tune_kernels, attention_kernel=args.attention_kernel)
    else:
        row = ours(pipe, variant, args.runs, cache, args.profile, tuned=args.tune_kernels,
                   attention_kernel=args.attention_kernel)
        if cache is not None:
            row["cache"] = hook_cache(args.cache).describe()
            variant = f"{variant}_{args.cache.replace(':', '_')}"
    row.update(setup, wall_s=time.perf_counter() - start, tune_kernels=args.tune_kernels)
    ours_variant = variant not in PEERS
    variant = (variant_name(variant, args, ours=ours_variant)
               + "_diffusers_rotary" * (args.diffusers_rotary and ours_variant)
               + "_per_step_modulations" * (args.per_step_modulations and ours_variant)
               + f"_{args.attention_kernel}" * (args.attention_kernel != "auto"))
    print(f"{variant}: best end to end {row['best_s']:.3f} s, first call {row['first_call_s']:.1f} s, "
          f"inference peak {row['inference_peak_gib']:.1f} GiB (set-up {row['setup_peak_gib']:.1f}), transformer "
          f"{row.get('transformer_ms_per_step', float('nan')):.1f} ms per step, non-finite values "
          f"{row['nonfinite_values']}", flush=True)
    return variant, row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="peer,compiled,fp8",
                        help=f"comma-separated: compiled, {', '.join(FP8_LEVELS)}, {', '.join(PEERS)}")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cache", default="", help="our variants under a cache hook: taylorseer:<interval>, "
                                                    "taylorseer_blocks:<interval> or first_block:<threshold>")
    parser.add_argument("--profile", action="store_true", help="our variants: GPU time per kernel over one call")
    add_compile_arguments(parser)
    add_attention_argument(parser)
    add_process_arguments(parser)
    parser.add_argument("--diffusers-rotary", action="store_true",
                        help="our variants keep q and k in diffusers' order (no use_rotary_halves); names each "
                             "variant <variant>_diffusers_rotary")
    parser.add_argument("--per-step-modulations", action="store_true",
                        help="our variants compute the AdaLN modulations at every step (no precompute_modulations); "
                             "names each variant <variant>_per_step_modulations")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in ("compiled", *FP8_LEVELS, *PEERS)]
    if unknown:
        parser.error(f"unknown variants {unknown}")
    if one_process_each(args, variants):
        return
    quiet_libraries()
    use_compile_arguments(args)
    # FLUX.use_family_forms looks the forms up here.
    if args.diffusers_rotary:
        flux.use_rotary_halves = lambda transformer: False
    if args.per_step_modulations:
        step_modulations.precompute_modulations = lambda transformer, adaln_norms: False
    results = json.loads(args.out.read_text()) if args.out.is_file() else {
        "benchmark": "flux_full_size", "device": torch.cuda.get_device_name(), "versions": report.library_versions(),
        "resolution": SIZE, "steps": STEPS, "guidance": GUIDANCE, "batch": 1, "variants": {}}
    cache = cache_block(args.cache)
    record_variant(results, args.out, variants[0], lambda: run_variant(variants[0], args, cache))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
