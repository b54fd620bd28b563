"""What decoding in a dtype whose range holds costs: the full-size SDXL VAE decoder (random weights)
at 1024x1024, one image a call as the torch backend decodes by default, compiled as the torch
backend compiles it (channels-last, its compiled forms), in fp16 (what an fp16-safe VAE allows),
bf16 (the backend's choice where the VAE's config says force_upcast, as SDXL-base's does) and fp32
(diffusers' own upcast), each timed on the same latents, with the bf16 and fp16 images' largest
difference from the fp32 ones. Needs a CUDA GPU.

    python benchmarks/vae_dtype_speed.py --out benchmarks/results/vae_dtype_h100.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sdquant.families.encoders import VaeDecoderGraph
from sdquant.families.base import full_size_on_gpu
from sdquant.families.sd import SDXL
from sdquant.report import library_versions
from sdquant.runtime.compiled_forms import use_compiled_forms

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def decoder(vae_of_dtype) -> torch.nn.Module:
    vae_of_dtype.to(memory_format=torch.channels_last)
    use_compiled_forms(vae_of_dtype)
    return torch.compile(VaeDecoderGraph(vae_of_dtype))


def median_ms(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    pipe = full_size_on_gpu(SDXL)
    latents = torch.randn(1, 4, 128, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    images, rows = {}, {}
    for name, dtype in DTYPES.items():
        graph = decoder(pipe.vae.to(dtype))
        with torch.no_grad():
            for _ in range(3):  # compiles, then warms up
                images[name] = graph(latents.to(dtype)).float()
            rows[name] = {"ms_per_image": median_ms(lambda: graph(latents.to(dtype)), args.runs),
                          "nonfinite_values": int((~torch.isfinite(images[name])).sum())}
        print(f"{name}: {rows[name]['ms_per_image']:.2f} ms an image", flush=True)
    for name in ("fp16", "bf16"):
        rows[name]["max_abs_difference_from_fp32"] = float((images[name] - images["fp32"]).abs().max())
        rows[name]["mean_abs_difference_from_fp32"] = float((images[name] - images["fp32"]).abs().mean())
    result = {"benchmark": "vae_dtype_speed", "device": torch.cuda.get_device_name(),
              "model": "SDXL's VAE decoder, full size, random weights, 1024x1024, one image a call, compiled",
              "tf32_convolutions": torch.backends.cudnn.allow_tf32, "versions": library_versions(), "dtypes": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
