"""Compares calibration recipes by image quality and prompt adherence against the fp16 UNet,
with evaluate.py's metrics.

Quantizes the model once per recipe (the default, NeMo's: Percentile Quant min-mean on convolution
inputs, its per-step sums divided by n_steps, Linear inputs at max for SmoothQuant alpha 0.8; then
one setting changed at a time: INT8 levels 1, 2, 2.5, 3; the true mean as divisor; 128 calibration
prompts with either divisor; sdquant's older recipe (Percentile Quant on every layer, true mean);
plain max; alpha 0.5 / 1.0; percentile 0.5; FP8 levels 3 and 4, at max as ModelOpt's example runs
FP8 and with Percentile Quant on convolutions), evaluates them all against one fp16 reference on
the scene model's held-out prompts, and copies the report to benchmarks/results/.

    python benchmarks/quality_recipes.py                 # the trained SDXL scene model, on a CPU
    python benchmarks/quality_recipes.py --model scenes_flux --recipes int8_l3_a05,int8_l3,int8_l3_a10,fp8_l3,fp8_l4 \
        --calib-batch 8
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from hydra import compose, initialize_config_dir

from sdquant.config import register_schemas, shipped_model_folder
from sdquant.workflow.evaluate import run_evaluate
from sdquant.workflow.quantize import run_quantize

REPO = Path(__file__).resolve().parents[1]
# The defaults (NeMo's: min-mean on convolutions, divided by n_steps; alpha 0.8; percentile 1.0;
# 32 prompts) unless a recipe says otherwise. Names become config keys, so they hold no dots:
# l25 is level 2.5, a05 alpha 0.5, c128 128 calibration prompts.
RECIPES = {
    "int8_l1": ["quantize.quant_level=1"],
    "int8_l2": ["quantize.quant_level=2"],
    "int8_l25": ["quantize.quant_level=2.5"],
    "int8_l3": ["quantize.quant_level=3"],
    "int8_l3_true_mean": ["quantize.quant_level=3", "quantize.mean_divisor=runs"],
    "int8_l3_c128": ["quantize.quant_level=3", "quantize.calib_size=128"],
    "int8_l3_c128_true_mean": ["quantize.quant_level=3", "quantize.calib_size=128", "quantize.mean_divisor=runs"],
    "int8_l3_older": ["quantize.quant_level=3", "quantize.percentile_layers=all", "quantize.mean_divisor=runs"],
    "int8_l3_max": ["quantize.quant_level=3", "quantize.collect_method=max"],
    "int8_l3_a05": ["quantize.quant_level=3", "quantize.alpha=0.5"],
    "int8_l3_a10": ["quantize.quant_level=3", "quantize.alpha=1.0"],
    "int8_l3_p05": ["quantize.quant_level=3", "quantize.percentile=0.5"],
    "fp8_l3": ["quantize.format=fp8", "quantize.quant_level=3"],
    "fp8_l4": ["quantize.format=fp8", "quantize.quant_level=4"],
    "fp8_l4_percentile": ["quantize.format=fp8", "quantize.quant_level=4", "quantize.percentile_layers=conv"],
    # Wan's blocks kept in 16 bits other than the recipe's (on the 8-block scene model, the recipe's
    # 0-2): a sensitivity pass, each of them in FP8 in turn, then all.
    **{f"fp8_l4_keep{''.join(map(str, kept)) or '_none'}": [
        "quantize.format=fp8", "quantize.quant_level=4", f"quantize.high_precision_blocks=[{','.join(map(str, kept))}]"]
       for kept in ((1, 2), (0, 2), (0, 1), ())},
}


def compose_app(config_name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="scenes_sdxl")
    parser.add_argument("--work", default=".scratch/quality_recipes", help="checkpoints and reports")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    parser.add_argument("--prompts-file", help="default: the shipped model's held-out prompts")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="which of the recipes, by name")
    parser.add_argument("--calib-batch", type=int, default=1,
                        help="prompts per calibration batch (the transformer's ranges do not depend on it: "
                             "no Percentile Quant on convolutions)")
    parser.add_argument("--device", default="cpu")
    add_kernels_argument(parser)
    parser.add_argument("--name", help="the results' name (default quality_recipes_<model>[_<kernels>_kernels])")
    args = parser.parse_args()
    register_schemas()
    variants = calibrated(args, {name: RECIPES[name] for name in args.recipes.split(",")})
    report_name = args.name or f"quality_recipes_{args.model}{kernels_suffix(args)}"
    evaluate_into_results(report_name, Path(args.work) / "report", [
        f"model={args.model}", f"device={args.device}", f"sampling.prompts_file={held_out_file(args)}",
        f"sampling.steps={args.steps}", f"sampling.width={args.size}", f"sampling.height={args.size}",
        f"torch_backend.quantized={args.kernels}", *[f"+variants.{name}={folder}" for name, folder in variants.items()]])


def add_kernels_argument(parser) -> None:
    parser.add_argument("--kernels", default="fake", choices=("fake", "fp8", "int8"),
                        help="how the checkpoints run (evaluate.py torch_backend.quantized): fake quantization, or "
                             "their format's kernels, as the torch backend runs them (their twins on a CPU)")


def kernels_suffix(args) -> str:
    """What a results file's name adds for checkpoints run on their format's kernels."""
    return "" if args.kernels == "fake" else f"_{args.kernels}_kernels"


def calibrated(args, recipes: dict[str, list[str]]) -> dict[str, Path]:
    """quantize.py once per recipe (name -> its overrides) on args.model into args.work; the
    checkpoint folder of each (one already there with the same settings is reused)."""
    common = [f"model={args.model}", f"device={args.device}", f"out_dir={Path(args.work) / 'quantized'}",
              f"quantize.batch_size={args.calib_batch}"]
    return {name: run_quantize(compose_app("sd_xl_quantize", common + overrides))
            for name, overrides in recipes.items()}


def held_out_file(args) -> Path:
    """--prompts-file, else the shipped model's held-out prompts."""
    return Path(args.prompts_file or Path(shipped_model_folder(args.model)) / "heldout_prompts.txt")


def evaluate_into_results(name: str, report_dir: Path, overrides: list[str]) -> dict:
    """evaluate.py with `overrides` (16 prompts a batch), its report and grid copied to
    benchmarks/results/<name>.md and <name>_grid.png; returns the report."""
    report = run_evaluate(compose_app("sd_xl_evaluate", [f"out_path={report_dir}", "sampling.batch_size=16", *overrides]))
    copy_report(name, report_dir)
    return report


def copy_report(name: str, report_dir: Path) -> None:
    """evaluate.py's report and grid in `report_dir` copied to benchmarks/results/<name>.md and
    <name>_grid.png."""
    from PIL import Image

    results = REPO / "benchmarks" / "results"
    shutil.copy(report_dir / "quality.md", results / f"{name}.md")
    # The grid is for looking at: in 256 colours, 128 prompts x 16 columns take 1.6 MB, not 7.8.
    grid = Image.open(report_dir / "grid.png").convert("RGB")
    grid.quantize(colors=256, dither=Image.Dither.NONE).save(results / f"{name}_grid.png", optimize=True)
    print(f"wrote {results / f'{name}.md'}")


if __name__ == "__main__":
    main()
