"""The Wan experts' GEMMs at a video's length, alone on the GPU: q, k and v as one GEMM of three
times the width against three GEMMs, and one call of both guidance halves (twice the rows) against
two calls of one, in bf16 (torch's Linear) and FP8 (the torch backend's Fp8Linear), for the
Wan2.2-T2V-A14B (5120 wide, 13,824 feed-forward, 75,600 tokens at 720x1280, 81 frames) and the
TI2V-5B (3072, 14,336; 27,280 tokens at 704x1280, 121 frames). FP8 inputs go in as FP8 (their
cast is fused into the kernel before). What the torch backend's choices for Wan rest on
(sdquant.families.wan.family: the A14B's q, k and v three GEMMs in bf16, the TI2V-5B's one, and
the guidance halves one call after the other).

    python benchmarks/gemm_shapes.py --out benchmarks/results/gemm_shapes_h200.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sdquant import report
from sdquant.runtime.kernels.fp8_layers import Fp8Linear

from group_norm_kernels import ms_per_call

# Per model: width, feed-forward width, tokens of one video.
MODELS = {"wan_t2v_a14b": (5120, 13824, 75600), "wan_ti2v_5b": (3072, 14336, 27280)}


def layer(features_in: int, features_out: int, fp8: bool) -> torch.nn.Module:
    linear = torch.nn.Linear(features_in, features_out, device="cuda", dtype=torch.bfloat16)
    if not fp8:
        return linear
    # Ranges the random values stay inside: the kernels' speed does not depend on them.
    return Fp8Linear.from_linear(linear, linear.weight.abs().amax().float(), torch.tensor(8.0, device="cuda"))


def gemm_rows(model: str, fp8: bool, repeats: int) -> list[dict]:
    width, ffn, tokens = MODELS[model]
    shapes = {"q, k or v; o": (width, width), "q, k and v as one": (width, 3 * width), "ffn up": (width, ffn),
              "ffn down": (ffn, width)}
    rows = []
    for name, (features_in, features_out) in shapes.items():
        gemm = layer(features_in, features_out, fp8)
        for samples in (1, 2):
            x = torch.randn(samples, tokens, features_in, device="cuda", dtype=torch.bfloat16)
            # FP8 rows go into the GEMM as they are: the cast is fused into the kernel before it.
            x = x.to(torch.float8_e4m3fn) if fp8 else x
            with torch.no_grad():
                ms = ms_per_call(lambda: gemm(x), repeats)
            rows.append({"model": model, "precision": "fp8" if fp8 else "bf16", "gemm": name, "samples": samples,
                         "rows": samples * tokens, "in": features_in, "out": features_out, "ms": ms,
                         "tflops": 2 * samples * tokens * features_in * features_out / ms / 1e9})
            print(json.dumps(rows[-1]), flush=True)
            del x
        del gemm
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gemm_shapes.py times GPU GEMMs: it needs a CUDA GPU")
    rows = [row for model in MODELS for fp8 in (False, True) for row in gemm_rows(model, fp8, args.repeats)]
    record = {"device": torch.cuda.get_device_name(), "versions": report.library_versions(), "rows": rows}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
