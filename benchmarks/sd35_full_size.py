"""infer_trt.py's torch backend on the full-size SD3.5-large architecture (random bf16 weights,
1024x1024, 28 steps, guidance 3.5 over a doubled batch, one image) against diffusers' own compiled
StableDiffusion3Pipeline, each variant in its own process (so peak memory is its own): the peer, our
compiled bf16 backend, our backend with FP8 GEMMs from this project's FP8 level-3 calibration (fp8),
and the same at level 4 with every attention as cuDNN's FP8 attention (fp8_l4; needs
nvidia-cudnn-frontend). End to end, transformer per step, peak GPU memory, compile time. Needs a
CUDA GPU; each results file names its device.

    python benchmarks/sd35_full_size.py --variants peer,compiled,fp8 --out benchmarks/results/sd35_h100.json
    python benchmarks/sd35_full_size.py --variants fp8_l4 --out benchmarks/results/sd35_h100.json

Several variants run one after another, each in a process of its own. The peer follows diffusers'
speed advice for SD3: channels-last weights, fused q/k/v projections (whose fused processor in
diffusers 0.42 skips SD3.5's q/k RMS norms: the peer computes a little less than the model, which
only helps its time), and torch.compile of the transformer with fullgraph=True and of the VAE decoder, in the default mode (the advised max-autotune
takes longer than the device's ten minutes a call; --peer-mode max-autotune asks for it). The FP8
variants calibrate the transformer with quantize.py's own calibration
(sdquant.quantize.calibrate.quantize_backbones: format=fp8, two denoising steps of one prompt at
1024x1024 through diffusers' pipeline; the GEMMs' speed does not depend on the values) and run it
with torch_backend.quantized=fp8.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from sdquant import report
from sdquant.families.sd3 import SD3
from sdquant.load import quiet_libraries
from flux_full_size import (FP8_LEVELS, GUIDANCE, PROMPT, SIZE, STEPS, build_variant, conversion_row, our_pipeline,
                            time_one_image)
from harness.measure import time_calls
from harness.peers import (add_attention_argument, add_compile_arguments, peer_attention, peer_compile,
                           use_compile_arguments, variant_name)
from sdquant.runtime.attention import chosen_kernel
from harness.processes import add_process_arguments, one_process_each, record_variant

CUDA = torch.device("cuda")
VARIANTS = ("peer", "compiled", *FP8_LEVELS)


def peer(pipe, runs: int, mode: str, tuned: bool, attention_kernel: str) -> dict:
    pipe.transformer.to(memory_format=torch.channels_last)
    pipe.vae.to(memory_format=torch.channels_last)
    pipe.transformer.fuse_qkv_projections()
    kernel = peer_attention([pipe.transformer], attention_kernel, CUDA)
    pipe.transformer = torch.compile(pipe.transformer, fullgraph=True, **peer_compile(tuned, mode))
    pipe.vae.decode = torch.compile(pipe.vae.decode, fullgraph=True, **peer_compile(tuned, mode))

    def call():
        return pipe(PROMPT, num_inference_steps=STEPS, guidance_scale=GUIDANCE, height=SIZE, width=SIZE,
                    output_type="pt", generator=torch.Generator("cuda").manual_seed(42),
                    **SD3.pipeline_call_kwargs(pipe)).images

    torch.cuda.reset_peak_memory_stats()
    return {**time_calls(call, runs), "inference_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "attention_kernel": kernel}


def ours(pipe, variant: str, runs: int, profile: bool, tuned: bool, attention_kernel: str) -> dict:
    pipeline = our_pipeline(pipe, "sd3", variant, tuned=tuned, attention_kernel=attention_kernel)
    settings = pipeline.settle([PROMPT], steps=STEPS, guidance_scale=GUIDANCE, height=SIZE, width=SIZE, seed=42)
    return {**time_one_image(pipeline, settings, runs, profile), **conversion_row(pipeline),
            "attention_kernel": chosen_kernel(attention_kernel, CUDA)}


def run_variant(variant: str, args) -> dict:
    start = time.perf_counter()
    pipe, setup = build_variant(SD3, variant)
    row = peer(pipe, args.runs, args.peer_mode, args.tune_kernels, args.attention_kernel) if variant == "peer" else \
        ours(pipe, variant, args.runs, args.profile, args.tune_kernels, args.attention_kernel)
    row.update(setup, wall_s=time.perf_counter() - start, tune_kernels=args.tune_kernels)
    if variant == "peer":
        row["compile_mode"] = args.peer_mode
    print(f"{variant}: best end to end {row['best_s']:.3f} s, first call {row['first_call_s']:.1f} s, "
          f"inference peak {row['inference_peak_gib']:.1f} GiB (set-up {row['setup_peak_gib']:.1f}), transformer "
          f"{row.get('transformer_ms_per_step', float('nan')):.1f} ms per step, non-finite values "
          f"{row['nonfinite_values']}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="peer,compiled,fp8", help=f"comma-separated: {', '.join(VARIANTS)}")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--peer-mode", default="default", help="the peer's torch.compile mode")
    parser.add_argument("--profile", action="store_true", help="our variants: GPU time per kernel over one call")
    add_compile_arguments(parser)
    add_attention_argument(parser)
    add_process_arguments(parser)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [variant for variant in variants if variant not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    # One process per variant: each one's peak memory and compiled code are its own.
    if one_process_each(args, variants):
        return
    quiet_libraries()
    results = json.loads(args.out.read_text()) if args.out.is_file() else {
        "benchmark": "sd35_full_size", "model": "SD3.5-large architecture, random bf16 weights",
        "device": torch.cuda.get_device_name(), "versions": report.library_versions(), "resolution": SIZE,
        "steps": STEPS, "guidance": GUIDANCE, "batch": 1, "variants": {}}
    use_compile_arguments(args)
    name = variant_name(variants[0], args, ours=variants[0] != "peer") + \
        f"_{args.attention_kernel}" * (args.attention_kernel != "auto")
    record_variant(results, args.out, variants[0], lambda: (name, run_variant(variants[0], args)))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
