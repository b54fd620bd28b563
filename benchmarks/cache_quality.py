"""Step caching against precision on the scene model: DeepCache settings on the fp16 UNet and on
its default INT8 (level 3) and FP8 (level 4) checkpoints, each against the uncached fp16 UNet, with
evaluate.py's metrics and one- and two-object adherence.

    python benchmarks/cache_quality.py                 # the trained scene model, on a CPU
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sdquant.config import register_schemas, shipped_model_folder
from sdquant.workflow.quantize import run_quantize
from quality_recipes import compose_app, evaluate_into_results

CHECKPOINTS = {"int8": ["quantize.quant_level=3"], "fp8": ["quantize.format=fp8", "quantize.quant_level=4"]}
# Variant name -> (checkpoint or None for the fp16 UNet, DeepCache interval or None, branch).
VARIANTS = {
    "fp16_i2": (None, 2, 0), "fp16_i3": (None, 3, 0), "fp16_i2_b1": (None, 2, 1),
    "int8": ("int8", None, 0), "int8_i2": ("int8", 2, 0), "int8_i3": ("int8", 3, 0),
    "fp8": ("fp8", None, 0), "fp8_i2": ("fp8", 2, 0), "fp8_i3": ("fp8", 3, 0),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="scenes_sdxl")
    parser.add_argument("--work", default=".scratch/cache_quality", help="checkpoints and reports")
    parser.add_argument("--prompts-file", default=str(Path(shipped_model_folder("scenes_sdxl")) / "heldout_prompts.txt"))
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    register_schemas()
    work = Path(args.work)
    common = [f"model={args.model}", f"device={args.device}", f"out_dir={work / 'quantized'}"]
    checkpoints = {name: run_quantize(compose_app("sd_xl_quantize", common + overrides))
                   for name, overrides in CHECKPOINTS.items()}
    variants, caches = [], []
    for name, (checkpoint, interval, branch) in VARIANTS.items():
        variants.append(f"+variants.{name}={checkpoints[checkpoint] if checkpoint else 'null'}")
        if interval is not None:
            caches.append(f"{name}:{{method:deepcache,interval:{interval},branch:{branch}}}")
    evaluate_into_results(f"cache_quality_{args.model}", work / "cache_report", [
        f"model={args.model}", f"device={args.device}", f"sampling.prompts_file={args.prompts_file}",
        "sampling.steps=20", *variants, "+variant_cache={" + ",".join(caches) + "}"])


if __name__ == "__main__":
    main()
