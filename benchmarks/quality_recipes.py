"""Compares calibration recipes by image quality against the fp16 UNet, with evaluate.py's metrics.

Quantizes the model once per recipe (INT8 level 3: plain max calibration vs Percentile Quant
min-mean, SmoothQuant alpha 0.5 / 0.8 / 1.0; FP8 level 4), then evaluates them all against one fp16
reference and copies the markdown report to benchmarks/results/. On the tiny random model this
shows that the tool works end to end, not how a real SDXL fares.

    python benchmarks/quality_recipes.py --model tiny_sdxl
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from hydra import compose, initialize_config_dir

from sdquant.config import register_schemas
from sdquant.workflow import run_evaluate, run_quantize

REPO = Path(__file__).resolve().parents[1]
RECIPES = {
    # Names become config keys, so they hold no dots: a05 is alpha 0.5.
    "int8_max_a08": ["quantize.collect_method=max", "quantize.alpha=0.8"],
    "int8_minmean_a05": ["quantize.alpha=0.5"],
    "int8_minmean_a08": ["quantize.alpha=0.8"],
    "int8_minmean_a10": ["quantize.alpha=1.0"],
    "fp8_l4_minmean": ["quantize.format=fp8", "quantize.quant_level=4"],
}


def compose_app(config_name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny_sdxl")
    parser.add_argument("--work", default=".scratch/quality_recipes", help="checkpoints and reports")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    parser.add_argument("--prompts-file", default=str(REPO / "benchmarks" / "quality_prompts.txt"))
    args = parser.parse_args()
    register_schemas()
    work = Path(args.work)
    common = [f"model={args.model}", "device=cpu", f"out_dir={work / 'quantized'}", "quantize.quant_level=3"]
    variants = {}
    for name, overrides in RECIPES.items():
        folder = run_quantize(compose_app("sd_xl_quantize", common + overrides))
        variants[name] = folder
    report_dir = work / "report"
    run_evaluate(compose_app("sd_xl_evaluate", [
        f"model={args.model}", "device=cpu", f"out_path={report_dir}", f"sampling.prompts_file={args.prompts_file}",
        f"sampling.steps={args.steps}", f"sampling.width={args.size}", f"sampling.height={args.size}",
        *[f"+variants.{name}={folder}" for name, folder in variants.items()]]))
    results = REPO / "benchmarks" / "results"
    shutil.copy(report_dir / "quality.md", results / f"quality_recipes_{args.model}.md")
    shutil.copy(report_dir / "grid.png", results / f"quality_recipes_{args.model}_grid.png")
    print(f"wrote {results / f'quality_recipes_{args.model}.md'}")


if __name__ == "__main__":
    main()
