"""The fused FP8 GEGLU (torch.ops.sdquant.fp8_geglu, a Triton kernel) against what the compiled FP8
backbone runs without it: torch._scaled_mm (cuBLAS) writing the 16-bit projection, then one compiled
kernel for the gating and the next GEMM's FP8 rounding. Kernel time only, at the GEGLU shapes of
the full-size SDXL UNet at 8 images per call (16 samples with guidance). Random values; each shape:
median of triton.testing.do_bench, the tile the autotuner chose, and how far the kernel's FP8
output is from its twin's (the dequantized GEMM, the gating and the rounding in the model's
precision) and the unfused one's from the same twin. Needs a Hopper GPU.

    python benchmarks/fp8_geglu_speed.py --out benchmarks/results/fp8_geglu_h200.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sdquant import report
from sdquant.runtime.kernels.fp8 import fp8_scales, to_fp8
from sdquant.runtime.kernels.fp8_geglu import fp8_geglu, reference_fp8_geglu

# name -> (tokens, in features, features after the gating, calls per UNet call)
SHAPES = {
    "640 channels (4096 tokens x 16)": (65536, 640, 2560, 10),
    "1280 channels (1024 tokens x 16)": (16384, 1280, 5120, 60),
}


def unfused(dtype: torch.dtype):
    """What the compiled backbone runs: cuBLAS's FP8 GEMM into `dtype`, then the gating and the FP8
    rounding in one compiled kernel."""
    def run(x, weight, x_scale, weight_scale, bias, out_inverse):
        out = torch._scaled_mm(x, weight.t(), scale_a=x_scale, scale_b=weight_scale, bias=bias, out_dtype=dtype,
                               use_fast_accum=True)
        value, gate = out.chunk(2, dim=-1)
        return to_fp8(value * torch.nn.functional.gelu(gate), out_inverse)

    return torch.compile(run)


def measure(shape: tuple) -> dict:
    import triton.testing

    from sdquant.runtime.kernels.fp8_geglu_triton import geglu

    tokens, in_features, features, calls = shape
    generator = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(tokens, in_features, device="cuda", generator=generator)
    weight = torch.randn(2 * features, in_features, device="cuda", generator=generator) / in_features ** 0.5
    bias = torch.randn(2 * features, device="cuda", generator=generator).half() * 0.1
    (x_inverse, x_scale), (w_inverse, w_scale) = fp8_scales(x.abs().amax()), fp8_scales(weight.abs().amax())
    out_inverse, _ = fp8_scales(torch.tensor(4.0, device="cuda"))
    args = (to_fp8(x, x_inverse), to_fp8(weight, w_inverse), x_scale, w_scale, bias, out_inverse)
    fused = fp8_geglu(*args, torch.float16)
    twin = reference_fp8_geglu(*args, torch.float16).float()
    baseline = unfused(torch.float16)
    baseline_out = baseline(*args)
    fused_ms = triton.testing.do_bench(lambda: fp8_geglu(*args, torch.float16))
    unfused_ms = triton.testing.do_bench(lambda: baseline(*args))
    flop = 2 * tokens * in_features * 2 * features
    return {"tokens": tokens, "in_features": in_features, "features": features, "calls": calls,
            "unfused_ms": unfused_ms, "fused_ms": fused_ms, "speedup": unfused_ms / fused_ms,
            "fused_tflops": flop / fused_ms / 1e9, "unfused_tflops": flop / unfused_ms / 1e9,
            "tile": str(geglu.best_config),
            # FP8 outputs: the share of elements rounded to another FP8 value than the twin's, and
            # the largest difference relative to the output's largest value.
            "differ_from_twin": float((fused.float() != twin).float().mean()),
            "max_error_from_twin": float((fused.float() - twin).abs().max() / twin.abs().max()),
            "unfused_differ_from_twin": float((baseline_out.float() != twin).float().mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = {}
    for name, shape in SHAPES.items():
        rows[name] = row = measure(shape)
        print(f"{name}: unfused {row['unfused_ms']:.3f} ms, fused {row['fused_ms']:.3f} ms ({row['speedup']:.2f}x, "
              f"{row['fused_tflops']:.0f} TFLOP/s), {row['tile']}, differ from the twin {row['differ_from_twin']:.4f} "
              f"(unfused {row['unfused_differ_from_twin']:.4f})", flush=True)
    per_call = {key: sum(row[key] * row["calls"] for row in rows.values()) for key in ("unfused_ms", "fused_ms")}
    result = {"benchmark": "fp8_geglu_speed", "device": torch.cuda.get_device_name(),
              "versions": report.library_versions(), "shapes": rows, "per_unet_call": per_call}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"per SDXL UNet call: unfused {per_call['unfused_ms']:.1f} ms, fused {per_call['fused_ms']:.1f} ms")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
