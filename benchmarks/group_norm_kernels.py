"""SDXL's FP8 UNet compiled under each layout the torch backend has used, one call timed with its
kernel profile and generated code, which show where three GroupNorm+SiLU kernels spent 19 ms a
call (docs/speed.md). The full-size UNet (random fp16 weights, FP8 level 3 as
torch_backend_full_size.py makes it), 16 samples at 1024x1024, each layout in an inductor cache of
its own: as the torch backend compiled it before (`as_is`), its block outputs pinned channels-last
(`pinned`, sdquant.runtime.compiled_forms), and pinned with the per-channel GroupNorm form
(`pinned_statistics`, what the torch backend does now for an 8-bit backbone). Writes milliseconds
per call, the kernel profile, and the generated code (a gzipped file a layout, beside the results
file). Needs a CUDA GPU.

    python benchmarks/group_norm_kernels.py [--layouts pinned,pinned_statistics] \
        --out benchmarks/results/group_norm_kernels_h100.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
from pathlib import Path

import torch

from sdquant import report
from sdquant.families.base import full_size_on_gpu
from sdquant.families.sd import SDXL
from sdquant.load import quiet_libraries
from sdquant.runtime.compiled_forms import pin_channels_last_outputs, use_compiled_forms

from harness.measure import kernel_profile
from torch_backend_full_size import quantize_unet

LAYOUTS = ("as_is", "pinned", "pinned_statistics")


def unet_inputs(samples: int) -> dict:
    return {"sample": torch.randn(samples, 4, 128, 128, device="cuda", dtype=torch.float16),
            "timestep": torch.full((samples,), 500.0, device="cuda"),
            "encoder_hidden_states": torch.randn(samples, 77, 2048, device="cuda", dtype=torch.float16),
            "added_cond_kwargs": {"text_embeds": torch.randn(samples, 1280, device="cuda", dtype=torch.float16),
                                  "time_ids": torch.tensor([[1024.0, 1024, 0, 0, 1024, 1024]] * samples,
                                                           device="cuda", dtype=torch.float16)}}


def ms_per_call(fn, calls: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def compiled_sources(cache_dir: Path) -> str:
    """Every generated output-code module under `cache_dir` (the compiled graphs, kernels inlined),
    concatenated."""
    parts = []
    for path in sorted(cache_dir.rglob("*.py")):
        text = path.read_text(errors="replace")
        if "def call(" in text:
            parts.append(f"# ===== {path.relative_to(cache_dir)}\n{text}")
    return "\n".join(parts)


def compiled_run(name: str, unet, inputs: dict, out_dir: Path) -> dict:
    """Compiles `unet` in an inductor cache of its own; its time, profile and generated code."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    torch._dynamo.reset()
    cache_dir = Path(tempfile.mkdtemp(prefix=f"inductor_{name}_"))
    with temporary_cache_dir(str(cache_dir)), torch.no_grad():
        compiled = torch.compile(unet)
        ms = ms_per_call(lambda: compiled(**inputs))
        profile = kernel_profile(compiled, inputs, top=16)
    source = out_dir / f"{name}.py.gz"
    source.write_bytes(gzip.compress(compiled_sources(cache_dir).encode()))
    print(f"{name}: {ms:.2f} ms a call", flush=True)
    return {"ms_per_call": ms, "kernel_profile": profile, "source": source.name}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="some of, in this order: " + ", ".join(LAYOUTS))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    # Pins and forms cannot be taken off a module again: a layout listed after a later one would
    # run with the later one's changes under its own name.
    if not set(layouts) <= set(LAYOUTS) or layouts != sorted(layouts, key=LAYOUTS.index):
        parser.error(f"--layouts {args.layouts}: give some of {', '.join(LAYOUTS)}, in that order")
    quiet_libraries()
    pipe = full_size_on_gpu(SDXL)
    quantize_unet(pipe, "fp8")
    unet = pipe.unet.to(memory_format=torch.channels_last)
    inputs = unet_inputs(args.samples)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    sources = args.out.parent / args.out.stem
    sources.mkdir(exist_ok=True)
    result = {"benchmark": "group_norm_kernels", "device": torch.cuda.get_device_name(),
              "versions": report.library_versions(), "samples": args.samples, "runs": {}}
    pinned = False
    for layout in layouts:
        if layout.startswith("pinned") and not pinned:
            pin_channels_last_outputs(unet)
            pinned = True
        if layout == "pinned_statistics":
            use_compiled_forms(unet)
        result["runs"][layout] = compiled_run(layout, unet, inputs, sources)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} and {sources}/")


if __name__ == "__main__":
    main()
