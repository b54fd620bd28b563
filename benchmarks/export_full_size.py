"""Exports the full-size SDXL UNet (random weights) to ONNX on this host and records
wall time and peak host memory; with --build, builds the engines with TensorRT-RTX too.
--recipe picks the UNet: fp16, int8:3 or fp8:4.

Each heavy step runs in its own process, as a user runs the scripts, so the peak memory of one
step is not inflated by another. Target: the INT8 export within 10 GB peak and 120 s.

    python benchmarks/export_full_size.py --work /tmp/sdxl_full --out benchmarks/results/export_full_size.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_GB, TARGET_S = 10.0, 120.0


def build_model(folder: Path) -> None:
    """The full-size SDXL architecture with random weights, saved in fp16 as a diffusers folder."""
    code = (
        "import torch; from sdquant.families.sd import SDXL; "
        "torch.set_default_dtype(torch.float16); "
        f"SDXL.build_pipeline(SDXL.sizes['full']).save_pretrained({str(folder)!r})"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# Runs a command and prints its peak RSS in KB: a fresh parent per measurement, since a process's
# RUSAGE_CHILDREN peak covers every child it has waited for.
_PEAK_OF = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def run_measured(args: list[str]) -> dict:
    """Runs a script in a child process; returns its wall time and peak RSS."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", _PEAK_OF, sys.executable, *args], check=True, cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    print(result.stdout)
    peak_kb = int(result.stdout.strip().splitlines()[-1])
    return {"seconds": round(seconds, 1), "peak_rss_gb": round(peak_kb / 1024**2, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="scratch folder (about 25 GB)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--build", action="store_true", help="also build the engines with TensorRT-RTX")
    parser.add_argument("--recipe", default="int8:3", help="fp16, or format:quant_level (int8:3, fp8:4)")
    args = parser.parse_args()

    model_dir, quantized_dir, export_dir = args.work / "model", args.work / "quantized", args.work / "export"
    if not (model_dir / "model_index.json").exists():
        build_model(model_dir)
    model = ["model=sdxl_base", f"model.source={model_dir}", "model.variant=null", "model.name=sdxl_random"]
    hydra_dir = f"hydra.run.dir={args.work / 'hydra'}"
    unet = []
    if args.recipe != "fp16":
        fmt, level = args.recipe.split(":")
        # The calibration itself is not measured here: one small step gives valid ranges to export.
        quantize = ["quantize.py", *model, f"quantize.format={fmt}", f"quantize.quant_level={level}",
                    "quantize.calib_size=1", "quantize.n_steps=1", "quantize.height=128", "quantize.width=128",
                    "device=cpu", "dtype=fp16", f"out_dir={quantized_dir}", hydra_dir]
        subprocess.run([sys.executable, *quantize], check=True, cwd=REPO)
        checkpoint = next(quantized_dir.glob(f"*_{fmt}_l{level}_*/unet.mto")).parent
        unet = [f"quantized_unet={checkpoint}"]

    common = ["export_trt.py", *model, *unet, f"infer.out_path={export_dir}", "device=cpu", "force=true", hydra_dir]
    export = [*common, "run_trt_export=false"]
    measured = run_measured(export)
    unet_meta = json.loads((export_dir / "onnx" / "unet_xl" / "export.json").read_text())
    report = {
        "benchmark": "export_full_size", "machine": f"{platform.node()} ({platform.processor() or platform.machine()})",
        "cpus": len(__import__("os").sched_getaffinity(0)),
        "what": f"export_trt.py: clip1, clip2, vae and the SDXL UNet ({args.recipe}; random weights), fp16 graphs",
        "recipe": args.recipe,
        "export": {**measured, "unet_seconds": unet_meta["seconds"]},
        "target": {"peak_rss_gb": TARGET_GB, "seconds": TARGET_S},
        "meets_target": measured["peak_rss_gb"] <= TARGET_GB and measured["seconds"] <= TARGET_S,
        "onnx_bytes": sum(p.stat().st_size for p in (export_dir / "onnx" / "unet_xl").iterdir()),
    }
    if args.build:
        engines = run_measured([*common, "run_onnx_export=false", "trt.backend=tensorrt_rtx"])
        plans = export_dir / "plan"
        report["tensorrt_rtx_build"] = {
            **engines,
            "unet_engine_bytes": (plans / "unet_xl.plan").stat().st_size,
            "unet_build_seconds": json.loads((plans / "engines.json").read_text())["unet_xl"]["build_seconds"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
