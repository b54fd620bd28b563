"""cuDNN's FP8 attention at one shape (by default the Wan2.2-T2V-A14B's self-attention at MLPerf's
720x1280, 81 frames: both guidance halves, 40 heads, 75,600 tokens, head_dim 128), run by each plan
cuDNN's heuristics A and B rank and in two layouts, beside torch's bf16 attention (flash and cuDNN
backends): milliseconds a call, TFLOP/s, and each plan's largest difference from the default plan's
output. At that shape attention is 76% of an FP8 level-4 expert step and the default FP8 plan runs
about 1.4x the 16-bit kernel (docs/speed.md); this says whether another plan or layout runs faster,
and, where FlashAttention-3 is installed (benchmarks/build_flash3.sh builds it), whether its bf16
and FP8 forwards do, with their outputs' differences from torch's and cuDNN's.

Layouts: "tokens-major" is (batch, tokens, heads, head_dim) memory read as (batch, heads, tokens,
head_dim), what the projections hand the torch backend's attention; "heads-major" is that shape
contiguous (a copy first).

    python benchmarks/fp8_attention_plans.py --out benchmarks/results/fp8_attention_plans_h100.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from sdquant import report
from sdquant.runtime.kernels.fp8 import fp8_scales, to_fp8
from sdquant.runtime.kernels.fp8_attention import (FLASH3_MODULES, CudnnGraph, _handle, _softmax_scales, flash3_function,
                                                   flash3_module)

from group_norm_kernels import ms_per_call

LAYOUTS = ("tokens-major", "heads-major")


def inputs(shape: tuple[int, int, int, int], layout: str, seed: int) -> dict[str, torch.Tensor]:
    """Random bf16 q, k and v of (batch, heads, tokens, head_dim) in `layout` (the kernels' speed
    does not depend on the values)."""
    batch, heads, tokens, head_dim = shape
    generator = torch.Generator("cuda").manual_seed(seed)
    made = {}
    for name in ("q", "k", "v"):
        x = torch.randn((batch, tokens, heads, head_dim), generator=generator, device="cuda", dtype=torch.bfloat16)
        x = x.transpose(1, 2)
        made[name] = x.contiguous() if layout == "heads-major" else x
    return made


def fp8_copies(bf16: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """FP8 copies of q, k and v at their per-tensor ranges, and each one's (scale, descale)."""
    scales = {name: fp8_scales(x.abs().amax().float()) for name, x in bf16.items()}
    return {name: to_fp8(x, scales[name][0]) for name, x in bf16.items()}, scales


def cudnn_scales(bf16: dict[str, torch.Tensor], scales: dict) -> dict[str, torch.Tensor]:
    """cuDNN's FP8 attention graph's scales: the inputs' descales, the softmax output's constant
    ones, and the output's at the values' range."""
    probability_inverse, probability_scale = _softmax_scales(bf16["q"].device)
    return {"descale_q": scales["q"][1], "descale_k": scales["k"][1], "descale_v": scales["v"][1],
            "descale_s": probability_scale, "scale_s": probability_inverse,
            "scale_o": fp8_scales(bf16["v"].abs().amax().float())[0]}


def fp8_rows(shape, layout: str, repeats: int, flops: float) -> list[dict]:
    """Each plan's time on FP8 copies of one layout's q, k and v, and its output's largest
    difference from the first plan's."""
    bf16 = inputs(shape, layout, seed=0)
    fp8, scales = fp8_copies(bf16)
    if layout == "heads-major":
        fp8 = {name: x.contiguous() for name, x in fp8.items()}
    graph_scales = cudnn_scales(bf16, scales)
    device = fp8["q"].device
    handle = _handle(device)
    batch, heads, tokens, head_dim = shape
    out = torch.empty((batch, tokens, heads, head_dim), dtype=torch.float8_e4m3fn, device=device).transpose(1, 2)
    graph = CudnnGraph(handle, fp8["q"], fp8["k"], fp8["v"], out, head_dim ** -0.5, every_plan=True)
    rows, first = [], None
    for index, name in enumerate(graph.plan_names()):
        row = {"layout": layout, "kernel": "cudnn fp8", "plan": index, "name": name}
        try:
            graph.use_plan(index)
        except Exception as error:  # a plan cuDNN declines for this graph is a row, not the end
            rows.append({**row, "declined": f"{type(error).__name__}: {error}"[:300]})
            continue
        ms = ms_per_call(lambda: graph.execute(handle, fp8, graph_scales, out), repeats)
        result = out.float()
        first = result if first is None else first
        rows.append({**row, "ms": ms, "tflops": flops / ms / 1e9,
                     "largest_difference_from_first_plan": float((result - first).abs().max())})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def flash3_rows(shape, repeats: int, flops: float) -> list[dict]:
    """FlashAttention-3 (the module installed: fa3-fwd's from PyPI, or the source build of
    benchmarks/build_flash3.sh) in the tokens-major layout it reads: its bf16 forward, with its output's largest difference from
    torch's cuDNN attention, and its FP8 forward on the same FP8 q, k and v as cuDNN's with their
    per-tensor scales, with its bf16 output's largest difference from cuDNN's FP8 output
    (dequantized) over the values' range. A row saying why where it is not installed."""
    module = flash3_module()
    if module is None:
        return [{"kernel": "flash-attention 3", "missing": f"none of {', '.join(FLASH3_MODULES)} is installed"}]
    flash_attn_func = flash3_function()
    bf16 = inputs(shape, "tokens-major", seed=0)
    batch, heads, _, head_dim = shape
    tokens_major = {name: x.transpose(1, 2) for name, x in bf16.items()}
    fp8, scales = fp8_copies(bf16)
    fp8 = {name: x.transpose(1, 2) for name, x in fp8.items()}
    # Its descales are per (batch, head): the per-tensor ones, repeated.
    descales = {f"{name}_descale": scales[name][1].reshape(1, 1).expand(batch, heads).contiguous() for name in fp8}
    calls = {"flash-attention 3 bf16": lambda: flash_attn_func(*tokens_major.values(), softmax_scale=head_dim ** -0.5),
             "flash-attention 3 fp8": lambda: flash_attn_func(*fp8.values(), softmax_scale=head_dim ** -0.5,
                                                              **descales)}
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        torch_bf16 = torch.nn.functional.scaled_dot_product_attention(*bf16.values()).float()
    references = {"flash-attention 3 bf16": ("torch_bf16_cudnn", torch_bf16),
                  "flash-attention 3 fp8": ("cudnn_fp8", cudnn_reference(bf16))}
    rows = []
    for kernel, call in calls.items():
        ms = ms_per_call(call, repeats)
        out = call().float().transpose(1, 2)
        name, reference = references[kernel]
        rows.append({"layout": "tokens-major", "kernel": kernel, "module": module, "ms": ms, "tflops": flops / ms / 1e9,
                     f"largest_difference_from_{name}": float((out - reference).abs().max()),
                     "values_amax": float(bf16["v"].abs().amax())})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def cudnn_reference(bf16: dict[str, torch.Tensor]) -> torch.Tensor:
    """cuDNN's FP8 attention (the plan it picks) of `bf16`'s FP8 copies, dequantized to fp32."""
    fp8, scales = fp8_copies(bf16)
    graph_scales = cudnn_scales(bf16, scales)
    batch, heads, tokens, head_dim = fp8["q"].shape
    out = torch.empty((batch, tokens, heads, head_dim), dtype=torch.float8_e4m3fn, device=fp8["q"].device)
    out = out.transpose(1, 2)
    handle = _handle(out.device)
    CudnnGraph(handle, fp8["q"], fp8["k"], fp8["v"], out, head_dim ** -0.5).execute(handle, fp8, graph_scales, out)
    return out.float() / graph_scales["scale_o"]


def bf16_rows(shape, layout: str, repeats: int, flops: float) -> list[dict]:
    q, k, v = inputs(shape, layout, seed=0).values()
    rows = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        with sdpa_kernel([backend]):
            ms = ms_per_call(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), repeats)
        rows.append({"layout": layout, "kernel": f"torch bf16 {backend.name.lower()}", "ms": ms,
                     "tflops": flops / ms / 1e9})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="2,40,75600,128", help="batch,heads,tokens,head_dim")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_attention_plans.py times cuDNN's kernels: it needs a CUDA GPU (Hopper or newer)")
    shape = tuple(int(size) for size in args.shape.split(","))
    batch, heads, tokens, head_dim = shape
    flops = 4.0 * batch * heads * tokens * tokens * head_dim
    rows = []
    for layout in LAYOUTS:
        rows += bf16_rows(shape, layout, args.repeats, flops) + fp8_rows(shape, layout, args.repeats, flops)
        torch.cuda.empty_cache()
    rows += flash3_rows(shape, args.repeats, flops)
    record = {"device": torch.cuda.get_device_name(), "versions": report.library_versions(), "shape": list(shape),
              "repeats": args.repeats, "rows": rows}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
