"""Exports the full-size Flux.1-dev pipeline (random weights) to ONNX on a GPU machine, as
export_trt.py does, and records time, peak host and GPU memory and the files' sizes.

The 12 B-parameter transformer (24 GB in 16 bits) does not fit this project's 24 GB CPU host, so
the pipeline is built on the GPU, calibrated there with quantize.py's own calibration (FP8 level 3,
one prompt, two steps at 1024x1024: the export does not depend on the values) and exported with the
export stage's own functions: the transformer traced on the meta device with its Q/DQ written from
the calibrated ranges, the encoders and VAE traced on their own (GPU) tensors, every weight streamed
once into the graph's external-data file. The model is not saved first (a 34 GB folder, a 24 GB
checkpoint and 34 GB of graphs would not fit the GPU machine's 64 GB disk together).

    python benchmarks/flux_export_full_size.py --work /tmp/flux_export --out benchmarks/results/flux_export_full_size_h100.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import time
from pathlib import Path

import torch

from sdquant.export import onnx_graphs
from sdquant.quantize.calibrate import quantize_backbones
from sdquant.config import QuantizeBlock
from sdquant.families.base import full_size_on_gpu
from sdquant.families.flux import FLUX
from sdquant.graphs.geometry import SampleGeometry
from sdquant.load import quiet_libraries
from sdquant.report import library_versions

PROMPT = "a photo of an astronaut riding a horse on mars"
SIZE, LATENT = 1024, 128
OPSET = 19


def peak_host_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="scratch folder (about 35 GB)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--graphs", default="clip,t5,vae,transformer", help="which graphs to export")
    args = parser.parse_args()
    quiet_libraries()
    start = time.perf_counter()
    pipe = full_size_on_gpu(FLUX).to(torch.float16)
    build_s = time.perf_counter() - start
    block = QuantizeBlock(format="fp8", quant_level=3.0, n_steps=2, calib_size=1, batch_size=1, height=SIZE,
                          width=SIZE, guidance_scale=3.5)
    start = time.perf_counter()
    quantize_backbones(pipe, FLUX, [PROMPT], block, seed=0, cuda_graph=False)
    calibrate_s = time.perf_counter() - start
    onnx_graphs.prepare_quantizers_for_export(pipe.transformer, torch.float16)
    graphs = {}
    for spec in FLUX.graph_specs(pipe, 1, SampleGeometry(1, SIZE, SIZE), LATENT, torch.float16, torch.float32):
        if spec.name not in args.graphs.split(","):
            continue
        if not spec.on_meta:
            device = next(spec.module.parameters()).device
            spec = dataclasses.replace(spec, args=tuple(a.to(device) for a in spec.args))
        folder = onnx_graphs.onnx_path(args.work, spec.name).parent
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        onnx_graphs.export_graph(spec, folder, OPSET, {"graph": spec.name}, torch.float32 if spec.name == "vae" else
                            torch.float16)
        files = onnx_graphs.graph_files(folder / onnx_graphs.ONNX_FILE)
        graphs[spec.name] = {"seconds": round(time.perf_counter() - started, 1), "on_meta": spec.on_meta,
                             "bytes": sum(f.stat().st_size for f in files), "files": [f.name for f in files],
                             "gpu_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                             "host_peak_gib_so_far": round(peak_host_gib(), 2)}
        print(spec.name, graphs[spec.name], flush=True)
    report = {
        "benchmark": "flux_export_full_size", "device": torch.cuda.get_device_name(), "versions": library_versions(),
        "what": "FLUX.1-dev architecture, random weights, FP8 level-3 transformer (quantize.py's calibration), "
                "fp16 graphs (VAE fp32), opset 19, batch 1, 1024x1024, T5 at 512 tokens",
        "build_s": round(build_s, 1), "calibrate_s": round(calibrate_s, 1),
        "export_s": round(sum(g["seconds"] for g in onnx_graphs.values()), 1), "host_peak_gib": round(peak_host_gib(), 2),
        "graphs": graphs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
