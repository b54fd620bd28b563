"""Step caching against precision on a scene model: cache settings (DeepCache on a UNet,
diffusers' TaylorSeer and First Block Cache hooks on a transformer) on the 16-bit backbone and on
its default INT8 (level 3) and FP8 (level 4) checkpoints, each against the uncached 16-bit backbone,
with evaluate.py's metrics and one- and two-object adherence.

    python benchmarks/cache_quality.py                 # the trained SDXL scene model, on a CPU
    python benchmarks/cache_quality.py --model scenes_flux --backbone transformer --calib-batch 8
    python benchmarks/cache_quality.py --model scenes_flux --backbone transformer --calib-batch 8 \
        --variants fp16_ts2,fp16_tsb2,fp8_l3,fp8_l3_tsb2,fp8,fp8_tsb2 --name cache_quality_scenes_flux_blocks
    python benchmarks/cache_quality.py --model scenes_wan --backbone transformer --variants fp16_tsb2_w1 \
        --name cache_quality_scenes_wan_unquantized
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sdquant.config import register_schemas
from quality_recipes import add_kernels_argument, calibrated, evaluate_into_results, held_out_file, kernels_suffix

CHECKPOINTS = {"int8": ["quantize.quant_level=3"], "fp8": ["quantize.format=fp8", "quantize.quant_level=4"],
               "fp8_l3": ["quantize.format=fp8", "quantize.quant_level=3"]}
# Per kind of backbone, variant name -> (checkpoint or None for the 16-bit backbone, cache settings
# as evaluate.py's variant_cache takes them, or None for uncached).
VARIANTS = {
    "unet": {
        "fp16_i2": (None, "{method:deepcache,interval:2,branch:0}"),
        "fp16_i3": (None, "{method:deepcache,interval:3,branch:0}"),
        "fp16_i2_b1": (None, "{method:deepcache,interval:2,branch:1}"),
        "int8": ("int8", None), "int8_i2": ("int8", "{method:deepcache,interval:2,branch:0}"),
        "int8_i3": ("int8", "{method:deepcache,interval:3,branch:0}"),
        "fp8": ("fp8", None), "fp8_i2": ("fp8", "{method:deepcache,interval:2,branch:0}"),
        "fp8_i3": ("fp8", "{method:deepcache,interval:3,branch:0}"),
    },
    "transformer": {
        "fp16_ts2": (None, "{method:taylorseer,interval:2}"),
        "fp16_ts3": (None, "{method:taylorseer,interval:3}"),
        "fp16_fbc005": (None, "{method:first_block,threshold:0.05}"),
        # The uncached 8-bit transformers are in the recipe table (quality_recipes.py); FP8's fake
        # quant takes 15 minutes a column on the 2-core CPU.
        "int8_ts2": ("int8", "{method:taylorseer,interval:2}"),
        "fp8_ts2": ("fp8", "{method:taylorseer,interval:2}"),
        # TaylorSeer over whole blocks, beside the uncached checkpoints it caches (FP8 level 3 is
        # what the FP8 GEMMs run).
        "fp16_tsb2": (None, "{method:taylorseer_blocks,interval:2}"),
        "fp8_l3": ("fp8_l3", None), "fp8_l3_tsb2": ("fp8_l3", "{method:taylorseer_blocks,interval:2}"),
        "fp8": ("fp8", None), "fp8_tsb2": ("fp8", "{method:taylorseer_blocks,interval:2}"),
        # The Wan video's cache (one full pass an expert first) on the 16-bit backbone: what the
        # peer's cached video, diffusers' WanPipeline under the same hook, draws.
        "fp16_tsb2_w1": (None, "{method:taylorseer_blocks,interval:2,warmup:1}"),
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="scenes_sdxl")
    parser.add_argument("--work", default=".scratch/cache_quality", help="checkpoints and reports")
    parser.add_argument("--prompts-file", help="default: the shipped model's held-out prompts")
    parser.add_argument("--backbone", choices=sorted(VARIANTS), default="unet",
                        help="unet: DeepCache settings; transformer: diffusers' cache hooks")
    parser.add_argument("--calib-batch", type=int, default=1, help="prompts per calibration batch")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variants", help="which of the backbone's variants, by name (default: all)")
    parser.add_argument("--name", help="the report's name in benchmarks/results/ (default: cache_quality_<model>)")
    add_kernels_argument(parser)
    args = parser.parse_args()
    register_schemas()
    chosen = chosen_variants(args)
    used = dict.fromkeys(checkpoint for checkpoint, _ in chosen.values() if checkpoint)
    checkpoints = calibrated(args, {name: CHECKPOINTS[name] for name in used})
    variants, caches = [], []
    for name, (checkpoint, cache) in chosen.items():
        variants.append(f"+variants.{name}={checkpoints[checkpoint] if checkpoint else 'null'}")
        if cache is not None:
            caches.append(f"{name}:{cache}")
    name = args.name or f"cache_quality_{args.model}{kernels_suffix(args)}"
    evaluate_into_results(name, Path(args.work) / "cache_report", [
        f"model={args.model}", f"device={args.device}", f"sampling.prompts_file={held_out_file(args)}",
        "sampling.steps=20", f"torch_backend.quantized={args.kernels}", *variants,
        "+variant_cache={" + ",".join(caches) + "}"])


def chosen_variants(args) -> dict:
    table = VARIANTS[args.backbone]
    names = args.variants.split(",") if args.variants else list(table)
    unknown = [name for name in names if name not in table]
    if unknown:
        raise SystemExit(f"--variants: {', '.join(unknown)} not among the {args.backbone} variants "
                         f"({', '.join(table)})")
    return {name: table[name] for name in names}


if __name__ == "__main__":
    main()
