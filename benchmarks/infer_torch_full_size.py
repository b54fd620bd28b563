"""Latency of infer_trt.py's pipeline with the torch backend on the full-size SDXL (random
weights), 1024x1024, batch 1: UNet ms per step, end to end, and the pipeline's own overhead
(end to end minus the stages). Target: overhead under 2% of end to end. Needs a CUDA GPU.

    python benchmarks/infer_torch_full_size.py --out benchmarks/results/infer_torch_full_size.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sdquant import report
from sdquant.api import from_pipeline
from sdquant.load import quiet_libraries
from sdquant.families.base import full_size_on_gpu
from sdquant.families.sd import SDXL

TARGET_OVERHEAD = 0.02


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="20,30")
    parser.add_argument("--timed-runs", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    quiet_libraries()

    pipeline = from_pipeline(full_size_on_gpu(SDXL), "sdxl", sampling={"scheduler": "euler"})
    rows = []
    for steps in (int(s) for s in args.steps.split(",")):
        settings = pipeline.settle(["a photo of an astronaut riding a horse on mars"], steps=steps,
                                   guidance_scale=5.0, height=1024, width=1024, seed=42)
        pipeline.run(settings, progress=False)  # warm-up
        timings = []
        for _ in range(args.timed_runs):
            torch.cuda.synchronize()
            drawn = pipeline.run(settings, progress=False)
            timings.append((drawn.seconds, drawn.stage_seconds))
        latency = report.latency_report(timings, 1, steps, ["unet_xl"])
        latency["meets_overhead_target"] = latency["pipeline_overhead_fraction"] < TARGET_OVERHEAD
        print(json.dumps(latency["ms"]), f"overhead {100 * latency['pipeline_overhead_fraction']:.2f}%")
        rows.append(latency)
    result = {"benchmark": "infer_torch_full_size", "device": torch.cuda.get_device_name(),
              "versions": report.library_versions(), "backend": "torch (diffusers modules, fp16, eager)",
              "resolution": 1024, "batch": 1, "guidance": "batched CFG", "target_overhead": TARGET_OVERHEAD,
              "runs": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
