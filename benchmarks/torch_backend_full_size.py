"""infer_trt.py's torch backend against diffusers' own compiled SDXL pipeline, on the full-size SDXL
architecture (random fp16 weights), 1024x1024, each variant in a process of its own: eager, compiled
fp16, compiled with FP8 GEMMs, compiled with INT8 GEMMs, and the peers, each timed end to end, with
the UNet per step, peak GPU memory and the compile time. Needs a CUDA GPU; each results file names
its device.

    python benchmarks/torch_backend_full_size.py --variants peer,eager,compiled,fp8 --batch 1 \\
        --out benchmarks/results/torch_backend_h100_b1.json
    python benchmarks/torch_backend_full_size.py --variants compiled,fp8 --cache-interval 2 --batch 4 ...
    python benchmarks/torch_backend_full_size.py --variants compiled,fp8,int8 --profile --batch 1 \\
        --out benchmarks/results/torch_backend_int8_h100_b1.json

The peer is diffusers' documented speed recipe: fuse_qkv_projections(), channels-last UNet and
VAE, torch.compile(unet, fullgraph=True) and torch.compile(vae.decode, fullgraph=True), default
mode. Both run the VAE in fp16 (force_upcast off), as with an fp16-safe VAE; infer_trt.py decodes
SDXL-base's own VAE in bf16, which benchmarks/vae_dtype_speed.py times as fast as fp16. The
other peers (PEERS) change one thing each: peer_cudagraphs compiles in mode="reduce-overhead" (CUDA
graphs), peer_autotune in "max-autotune-no-cudagraphs" (past the device's ten minutes a call on
SDXL so far), and torchao_row / torchao_tensor first turn the UNet's Linear layers into torchao's
dynamic FP8 (`quantize_(unet, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow() or
PerTensor(), activation_value_lb=1e-12))`, compiled with torch's default settings (harness/peers.py
says why not torchao's set_inductor_config); the activation scale has a floor, without which the rows of SDXL's zeroed negative-prompt
embeddings quantize to NaN per row, pytorch/ao issue 4713). Per-row FP8 takes bf16
weights only: torchao_row runs the whole pipeline in bf16 (its row says "dtype"). Needs torchao
(the `peers` extra); where it does not import, the variant's row holds the error:

    python benchmarks/torch_backend_full_size.py --variants peer,peer_cudagraphs,torchao_row,torchao_tensor,fp8 \\
        --steps 20 --runs 3 --batch 1 --variant-timeout 480 --out benchmarks/results/sdxl_peers_h100_b1.json

Several variants run one after another, each in a process of its own (its peak memory, compiled
code and CUDA graphs its own); a variant past --variant-timeout seconds is stopped and its row says
so. Every row counts the non-finite values of its last images (nonfinite_values).

The FP8 variants quantize the UNet with this project's recipe (format=fp8) at level 3 (fp8) or 4
(fp8_l4, whose self-attention then runs as cuDNN's FP8 attention: needs nvidia-cudnn-frontend;
cross-attention stays in fp16, as the recipe keeps it), calibrated on two random UNet calls (the
kernels' speed does not depend on the values), tie the ranges quantize.py ties (q/k/v as one GEMM)
and run with torch_backend.quantized=fp8; the INT8 variant does the same with the level-3 INT8
recipe (SmoothQuant, whose per-channel input scales the INT8 layers then multiply in) and
torch_backend.quantized=int8:

    python benchmarks/torch_backend_full_size.py --variants fp8,fp8_l4,int8 --batch 8 --profile \
        --out benchmarks/results/torch_backend_8bit_h100_b8.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from sdquant import report
from sdquant.api import from_pipeline
from sdquant.config import QuantFormat, QuantizeBlock, TorchBackendBlock
from sdquant.families.base import full_size_on_gpu
from sdquant.families.sd import SDXL
from sdquant.load import quiet_libraries
from sdquant.quantize.recipe import calibration_algorithm
from sdquant.quantize.shared_ranges import tie_fp8_ranges
from sdquant.runtime.kernels.fp8_layers import Fp8Conv2d
from harness.measure import graphs_compiled, kernel_profile, nonfinite_values, time_calls, timed
from harness.peers import PEERS, add_compile_arguments, compile_peer, cudagraph_skips, use_compile_arguments, variant_name
from harness.processes import add_process_arguments, one_process_each, record_variant

PROMPT = "a photo of an astronaut riding a horse on mars"
SIZE = 1024
# NeMo's published H100 latencies (seed 001), ms at batch 1 / 2 / 4, 20 steps as in its defaults.
NEMO_H100_MS = {"framework fp16": [3056.01, 4832.24, 8433.71], "TensorRT fp16": [1723.97, 3004.47, 5657.19],
                "TensorRT INT8": [1406.68, 2403.29, 4252.6]}
# One UNet call at batch 2 and 1024x1024: 13.5 TFLOP.
UNET_TFLOP_BATCH2 = 13.5


def peer_pipeline(pipe, variant: str, tuned: bool) -> tuple[object, dict]:
    """diffusers' SDXL pipeline with its documented torch.compile recipe, as `variant` of PEERS."""
    if PEERS[variant][1] == "PerRow":  # torchao's per-row FP8 takes bf16 weights only
        pipe.to(torch.bfloat16)
    pipe.fuse_qkv_projections()
    pipe.unet.to(memory_format=torch.channels_last)
    pipe.vae.to(memory_format=torch.channels_last)
    pipe.vae.register_to_config(force_upcast=False)
    return pipe, compile_peer(pipe, "unet", variant, tuned)


# Our 8-bit variants: the format and quant level each runs.
QUANTIZED_VARIANTS = {"fp8": (QuantFormat.fp8, 3.0), "fp8_l4": (QuantFormat.fp8, 4.0), "int8": (QuantFormat.int8, 3.0)}


def quantize_unet(pipe, variant: str) -> None:
    """Quantizes the UNet in memory with the project's recipe at the variant's format and level on two
    random calls (the kernels' speed does not depend on the values), tying the ranges quantize.py ties."""
    import modelopt.torch.quantization as mtq

    fmt, level = QUANTIZED_VARIANTS[variant]
    config = {"quant_cfg": SDXL.quant_cfg_entries(fmt, level),
              "algorithm": calibration_algorithm(fmt, level, QuantizeBlock.alpha)}
    generator = torch.Generator("cuda").manual_seed(0)
    inputs = dict(sample=torch.randn(2, 4, 128, 128, device="cuda", dtype=torch.float16, generator=generator),
                  timestep=torch.tensor([500.0, 500.0], device="cuda"),
                  encoder_hidden_states=torch.randn(2, 77, 2048, device="cuda", dtype=torch.float16,
                                                    generator=generator),
                  added_cond_kwargs={"text_embeds": torch.randn(2, 1280, device="cuda", dtype=torch.float16),
                                     "time_ids": torch.tensor([[1024.0, 1024, 0, 0, 1024, 1024]] * 2,
                                                              device="cuda", dtype=torch.float16)})

    def forward_loop(unet):
        for _ in range(2):
            unet(**inputs)

    with torch.no_grad():
        mtq.quantize(pipe.unet, config, forward_loop)
    tie_fp8_ranges(pipe.unet, SDXL.attention_projections)


def our_pipeline(pipe, variant: str, args, cache: dict | None = None):
    """`pipe` built into our pipeline as infer_trt.py builds it (sdquant.api.from_pipeline): eager, or
    compiled with CUDA graphs; an 8-bit variant's UNet, quantized in memory, on its format's kernels."""
    quantized = QUANTIZED_VARIANTS.get(variant)
    kernels = {"quantized": quantized[0].value} if quantized else {}
    return from_pipeline(pipe, "sdxl", None if quantized is None else (quantized[0].value, quantized[1]),
                         torch_backend={"compile": variant != "eager", "vae_batch": args.vae_batch,
                                        "tune_kernels": args.tune_kernels, **kernels},
                         cuda_graph=variant != "eager", sampling={"scheduler": "euler", **({"cache": cache} if cache else {})})


def measure_ours(pipeline, batch: int, steps_list: list[int], runs: int) -> tuple[dict, torch.Tensor]:
    """The variant's timings at each step count, and the images of its last call (8-bit, on the CPU)."""
    result = {}
    for steps in steps_list:
        settings = pipeline.settle([PROMPT] * batch, steps=steps, guidance_scale=5.0, height=SIZE, width=SIZE, seed=42)
        first = timed(lambda: pipeline.run(settings, progress=False), 1)[0]
        pipeline.run(settings, progress=False)  # replays start with the 3rd call
        graphs = graphs_compiled()
        seconds = timed(lambda: pipeline.run(settings, progress=False), runs)
        graphs = graphs_compiled() - graphs
        drawn = pipeline.run(settings, progress=False)
        stage = report.latency_report([(min(seconds), drawn.stage_seconds)], batch, steps, ["unet_xl"])
        result[f"{steps}_steps"] = {"first_call_s": first, "end_to_end_s": seconds, "best_s": min(seconds),
                                    "unet_ms_per_step": stage["ms"]["backbone_per_step"], "vae_ms": stage["ms"]["vae"],
                                    "text_ms": stage["ms"]["text_encoders"], "graphs_compiled_while_timed": graphs,
                                    "nonfinite_values": nonfinite_values(drawn.samples)}
    return result, (drawn.samples * 255).round().to(torch.uint8).cpu()


def measure_peer(pipe, batch: int, steps_list: list[int], runs: int) -> dict:
    result = {}
    for steps in steps_list:
        def call():
            return pipe(PROMPT, num_images_per_prompt=batch, num_inference_steps=steps, guidance_scale=5.0,
                        height=SIZE, width=SIZE, output_type="pt",
                        generator=torch.Generator("cuda").manual_seed(42)).images
        result[f"{steps}_steps"] = time_calls(call, runs)
    return result


def save_images(images: torch.Tensor, path: Path) -> dict:
    """Saves `images` (8-bit) at `path`, and says where, with their digest: variants whose kernels sum
    in the same order draw the same one."""
    import hashlib

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(images, path)
    return {"file": path.name, "sha256": hashlib.sha256(images.numpy().tobytes()).hexdigest()}


def stage_profiles(pipeline, batch: int) -> dict[str, list[dict]]:
    """The kernel profiles of one UNet call (CFG: 2 * batch samples) and one VAE decode of the batch."""
    latent = SIZE // 8
    unet_inputs = {"x": torch.randn(2 * batch, 4, latent, latent, device="cuda", dtype=torch.float16),
                   "timesteps": torch.full((2 * batch,), 500.0, device="cuda"),
                   "context": torch.randn(2 * batch, 77, 2048, device="cuda", dtype=torch.float16),
                   "y": torch.randn(2 * batch, 2816, device="cuda", dtype=torch.float16)}
    vae_inputs = {"latent": torch.randn(batch, 4, latent, latent, device="cuda", dtype=torch.float16)}
    return {"unet_profile": kernel_profile(lambda: pipeline.stages["unet_xl"](**unet_inputs)),
            "vae_profile": kernel_profile(lambda: pipeline.stages["vae"](**vae_inputs))}


def run_variant(variant: str, args, steps_list: list[int], cache: dict | None) -> tuple[str, dict]:
    """Builds, compiles and times one variant; its name (with the arguments' suffixes) and row."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    pipe = full_size_on_gpu(SDXL)
    start = time.perf_counter()
    if variant in PEERS:
        pipe, setup = peer_pipeline(pipe, variant, args.tune_kernels)
        row = {**measure_peer(pipe, args.batch, steps_list, args.runs), **setup,
               "cudagraph_skips": cudagraph_skips()}
        images = None
    else:
        if variant in QUANTIZED_VARIANTS:
            quantize_unet(pipe, variant)
        pipeline = our_pipeline(pipe, variant, args, cache)
        row, images = measure_ours(pipeline, args.batch, steps_list, args.runs)
        conversion = pipeline.conversions.get("unet")
        row["quantized_layers"] = conversion.layers if conversion else 0
        row["fp8_attention_layers"] = conversion.attention if conversion else 0
        row["fp8_conv_layers"] = sum(isinstance(module, Fp8Conv2d) for module in pipe.unet.modules())
        if cache is not None:
            row["cache"] = pipeline.run_settings.cache.describe()
            variant = f"{variant}_deepcache_i{cache['interval']}_b{cache['branch']}"
        row["vae_batch"] = args.vae_batch
        if args.vae_batch != TorchBackendBlock.vae_batch:
            variant = f"{variant}_vae{args.vae_batch}"
        if args.profile:
            row.update(stage_profiles(pipeline, args.batch))
    row["tune_kernels"] = args.tune_kernels
    variant = variant_name(variant, args, ours=variant not in PEERS)
    if args.images and images is not None:
        row["images"] = save_images(images, args.images / f"{variant}_b{args.batch}.pt")
    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    # What the process holds from the GPU: the tensors' peak plus the allocator's cache and the
    # CUDA graphs' private pools.
    row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    row["wall_s"] = time.perf_counter() - start
    summary = {k: round(v["best_s"], 3) for k, v in row.items() if k.endswith("_steps")}
    print(f"{variant}: best end to end {summary}, first call {row[f'{steps_list[0]}_steps']['first_call_s']:.1f} s, "
          f"peak {row['peak_gib']:.1f} GiB, non-finite values "
          f"{[v['nonfinite_values'] for k, v in row.items() if k.endswith('_steps')]}", flush=True)
    return variant, row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="peer,eager,compiled,fp8",
                        help=f"comma-separated: eager, compiled, {', '.join(QUANTIZED_VARIANTS)}, {', '.join(PEERS)}")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", default="20,30")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--profile", action="store_true", help="kernel time of one UNet call and one VAE decode per torch variant")
    parser.add_argument("--cache-interval", type=int, default=0,
                        help="our variants with DeepCache, the whole UNet every N steps (0: no cache)")
    parser.add_argument("--cache-branch", type=int, default=0, help="DeepCache's live branch")
    parser.add_argument("--vae-batch", type=int, default=TorchBackendBlock.vae_batch,
                        help="our variants' torch_backend.vae_batch (0: the whole batch at once); another than "
                             "the default names the variant <variant>_vae<N>")
    parser.add_argument("--images", type=Path,
                        help="a folder for each of our variants' images of its last call at the last step count "
                             "(<variant>_b<batch>.pt, 8-bit), for comparing variants run in other processes")
    add_compile_arguments(parser)
    add_process_arguments(parser)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in ("eager", "compiled", *QUANTIZED_VARIANTS, *PEERS)]
    if unknown:
        parser.error(f"unknown variants {unknown}")
    if one_process_each(args, variants):
        return
    quiet_libraries()
    steps_list = [int(s) for s in args.steps.split(",")]
    # Variants run in separate processes (a compile each); they add to one file per batch.
    results = json.loads(args.out.read_text()) if args.out.is_file() else {
        "benchmark": "torch_backend_full_size", "device": torch.cuda.get_device_name(),
        "versions": report.library_versions(), "resolution": SIZE, "batch": args.batch,
        "nemo_published_h100_ms": NEMO_H100_MS, "unet_tflop_per_call_batch2": UNET_TFLOP_BATCH2, "variants": {}}
    cache = {"method": "deepcache", "interval": args.cache_interval, "branch": args.cache_branch} \
        if args.cache_interval else None
    use_compile_arguments(args)
    record_variant(results, args.out, variants[0], lambda: run_variant(variants[0], args, steps_list, cache))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
