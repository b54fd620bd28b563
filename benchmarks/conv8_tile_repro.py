"""Why two tiles of the TMA convolution kernel (sdquant.runtime.kernels.conv8_triton.tiled) computed
wrong sums where a tile spans several image rows: a minimal reproducer, on a Hopper GPU.

The kernel reads each filter tap's pixels as one 4-D TMA box (sample, rows, columns, channels) and
reshapes it to (pixels, channels) for the dot. Where the box holds one image row, Triton folds the
reshape into the load and the wgmma reads the box from shared memory. Where it holds several rows,
Triton 3.6 loads the box into registers and, as the dot's first operand, feeds it to a register-
sourced wgmma, split into 32-channel pieces; the pipelined loop leaves the last pieces' wgmmas in
flight (wgmma.wait_group 3 at 128-channel steps, 1 at 64) and the next step's ldmatrix overwrites
their registers: ptxas before CUDA 13.3 does not hold the writes back (triton-lang/triton#9433).
The result depends on timing. With the box as the dot's second operand (filters first, the sums
transposed), the wgmma reads it from shared memory at every shape: what the kernel now does.

Parts, each against exact or fp32 references on the same GPU:
  box   one box TMA-loaded, reshaped and stored, no dot: the descriptor, box and reshape alone.
  gemm  a loop of boxes times a weight strip, nothing else of the convolution, in both operand
        orders, one tile at a time, at one row per tile and at several; FP8 data are small integers,
        so every sum is exact and a wrong one is a counted element.
  conv  the project's kernel forced to one tile at a time against the fp32 twin at widths 20-200.
  speed the project's kernel, one tile at a time, at one ResNet convolution per depth of SDXL's UNet.
Each gemm case also says how Triton compiled it: the box in registers, and how many wgmmas the
loop leaves in flight. On an H100 with Triton 3.6 (benchmarks/results/conv8_tile_repro_h100.json):
every box exact; with the box first and 3 wgmmas in flight, 31% of the sums wrong at 128 pixels by
256 channels, 1.7% at 128 by 128 (0.1% with 4 warps), none at one row per tile, with the filters
first, unpipelined or at 64-channel steps, nor at 256 pixels or with 2 stages, which have the same
hazard in their code (timing). The kernel as it was (conv8_tile_repro_before_h100.json): 16-20% off
at 128 by 256 on tiles of several rows (its 128 by 128 sibling right that time); every tile right
after the change.

    PYTHONPATH=. python3 benchmarks/conv8_tile_repro.py --out benchmarks/results/conv8_tile_repro_h100.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from sdquant.runtime.kernels import conv8, conv8_triton

# The two tiles that were dropped, then the four that were kept: (pixels, channels, channel step,
# warps, stages), as conv8_triton's lists.
DROPPED = ((128, 256, 128, 8, 3), (128, 128, 128, 8, 3))
KEPT = ((256, 128, 128, 8, 3), (256, 128, 64, 8, 4), (128, 256, 64, 8, 4), (128, 128, 64, 4, 4))
# The dropped tiles with one thing changed at a time: warps (the 128-channel one: 4 warps hold its
# sums), stages (1: not pipelined), channel step.
ISOLATION = ((128, 128, 128, 4, 3), (128, 256, 128, 8, 2), (128, 256, 128, 8, 1), (128, 256, 64, 8, 3))
FORMATS = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
CHANNELS = 2304  # a 3x3 filter over 256 channels: the reduction of one convolution
ROWS = 16384  # pixels: a 128x128 latent, enough tiles to fill the GPU
OUT_CHANNELS = 512


@triton.jit
def _box_copy(x, out, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, TILE_H: tl.constexpr):
    box = x.load([0, tl.program_id(0) * TILE_H - 1, -1, 0]).reshape(BLOCK_M, BLOCK_K)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.store(out + rows[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :], box)


@triton.jit
def _box_gemm(x, weight, out, out_channels, REDUCTION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, TILE_H: tl.constexpr, PIXELS_FIRST: tl.constexpr, INTEGER: tl.constexpr):
    col0 = tl.program_id(1) * BLOCK_N
    acc_type = tl.int32 if INTEGER else tl.float32
    if PIXELS_FIRST:
        sums = tl.full((BLOCK_M, BLOCK_N), 0, acc_type)
    else:
        sums = tl.full((BLOCK_N, BLOCK_M), 0, acc_type)
    for k in range(0, REDUCTION, BLOCK_K):
        box = x.load([0, tl.program_id(0) * TILE_H, 0, k]).reshape(BLOCK_M, BLOCK_K)
        if PIXELS_FIRST:
            sums = tl.dot(box, weight.load([col0, k]).T, sums, out_dtype=acc_type)
        else:
            sums = tl.dot(weight.load([col0, k]), box.T, sums, out_dtype=acc_type)
    if not PIXELS_FIRST:
        sums = sums.T
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    tl.store(out + rows[:, None] * out_channels + cols[None, :], sums.to(tl.float32))


def _small_integers(shape, dtype, generator, high: int) -> torch.Tensor:
    """Integers in [-high, high], exact in FP8 and INT8, whose products sum exactly in fp32."""
    values = torch.randint(-high, high + 1, shape, device="cuda", generator=generator)
    return values.to(torch.float32).to(dtype)


def _compiled_as(kernel) -> dict:
    """From the kernel's TritonGPU IR: whether the box reached the dot through registers, and the
    most wgmmas the loop leaves in flight."""
    ir = kernel.asm["ttgir"]
    pending = [int(n) for n in re.findall(r"pendings = (\d+)", ir)]
    return {"box_in_registers": "ttg.local_load" in ir, "wgmmas_in_flight": max(pending, default=0)}


def box_case(tile_w: int, block_k: int) -> dict:
    """One 4-D box per program, image rows of `tile_w` pixels, shifted up and left by one so every
    box overhangs the border: TMA fills the outside with zeros."""
    block_m, height = 128, 64
    tile_h = block_m // tile_w
    x = torch.randint(-100, 100, (1, height, tile_w, block_k), device="cuda", dtype=torch.int8)
    descriptor = TensorDescriptor(x, list(x.shape), list(x.stride()), [1, tile_h, tile_w, block_k])
    out = torch.empty(height * tile_w, block_k, device="cuda", dtype=torch.int8)
    _box_copy[(height // tile_h,)](descriptor, out, block_m, block_k, tile_h)
    padded = torch.nn.functional.pad(x, (0, 0, 1, 0, 1, 0))[:, :height, :tile_w]
    return {"tile_w": tile_w, "block_k": block_k, "exact": bool(torch.equal(out, padded.reshape(-1, block_k)))}


def gemm_case(fmt: str, tile: tuple, tile_w: int, pixels_first: bool, runs: int = 3) -> dict:
    """`runs` launches of the box loop with one tile; wrong elements counted against the exact sums."""
    block_m, block_n, block_k, warps, stages = tile
    generator = torch.Generator("cuda").manual_seed(0)
    x = _small_integers((1, ROWS // tile_w, tile_w, CHANNELS), FORMATS[fmt], generator, 2)
    weight = _small_integers((OUT_CHANNELS, CHANNELS), FORMATS[fmt], generator, 2)
    expected = x.reshape(ROWS, CHANNELS).float() @ weight.float().T
    x_box = TensorDescriptor(x, list(x.shape), list(x.stride()), [1, block_m // tile_w, tile_w, block_k])
    weight_box = TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [block_n, block_k])
    wrong, worst = 0, 0.0
    for _ in range(runs):
        out = torch.zeros(ROWS, OUT_CHANNELS, device="cuda")
        kernel = _box_gemm[(ROWS // block_m, OUT_CHANNELS // block_n)](
            x_box, weight_box, out, OUT_CHANNELS, CHANNELS, block_m, block_n, block_k, block_m // tile_w,
            pixels_first, fmt == "int8", num_warps=warps, num_stages=stages)
        wrong += int((out != expected).sum())
        worst = max(worst, float((out - expected).norm() / expected.norm()))
    return {"format": fmt, "tile": tile, "tile_w": tile_w, "pixels_first": pixels_first,
            "wrong_fraction": wrong / (runs * expected.numel()), "relative_error": worst, **_compiled_as(kernel)}


def _operands(fmt: str, samples: int, channels: int, height: int, width: int, seed: int):
    """A 3x3 convolution's quantized operands as the op takes them (channels in and out alike),
    and the op's twin."""
    generator = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(samples, channels, height, width, device="cuda", generator=generator)
    x = x.contiguous(memory_format=torch.channels_last)
    weight = torch.randn(channels, 3, 3, channels, device="cuda", generator=generator) * 0.05
    if fmt == "fp8":
        x_scale, weight_scale = x.abs().amax() / 448, weight.abs().amax() / 448
        x8, weight8 = (x / x_scale).to(torch.float8_e4m3fn), (weight / weight_scale).to(torch.float8_e4m3fn)
        twin = conv8.reference_fp8_conv2d
    else:
        x_scale, weight_scale = 127 / x.abs().amax(), 127 / weight.abs().amax(dim=(1, 2, 3))
        x8 = (x * x_scale).round().clamp(-127, 127).to(torch.int8)
        weight8 = (weight * weight_scale.reshape(-1, 1, 1, 1)).round().clamp(-127, 127).to(torch.int8)
        twin = conv8.reference_int8_conv2d
    assert conv8_triton._tiled_fits(x8, 1)
    return (x8, weight8, x_scale.reshape(1), weight_scale.reshape(-1), None, 1, 1), twin


def _run(tile: tuple, arguments: tuple):
    """The project's tiled kernel with only `tile` to choose, on `arguments`; a function of no
    arguments that runs it again."""
    tiled = conv8_triton.tiled
    tiled.configs, tiled.cache = conv8_triton._configs((tile,), conv8_triton._set_blocks), {}
    out = conv8.conv_output(arguments[0], arguments[1], 1, 1, torch.float16)
    return lambda: conv8_triton.triton_conv2d(*arguments, out)


def conv_case(fmt: str, tile: tuple, width: int) -> dict:
    """Two samples of 12 rows, 256 channels, against the twin in fp32."""
    arguments, twin = _operands(fmt, 2, 256, 12, width, seed=width)
    got = _run(tile, arguments)()
    expected = twin(*arguments, torch.float32)
    return {"format": fmt, "tile": tile, "width": width,
            "relative_error": float((got.float() - expected).norm() / expected.norm())}


def speed_case(tile: tuple, channels: int, size: int) -> dict:
    """Kernel time in FP8 at a ResNet block's convolution of SDXL's UNet, 16 samples (8 images with
    guidance) at 1024x1024."""
    arguments, _ = _operands("fp8", 16, channels, size, size, seed=size)
    return {"tile": tile, "channels": channels, "size": size, "ms": triton.testing.do_bench(_run(tile, arguments))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="box,gemm,conv,speed")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    found = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__}
    parts = args.parts.split(",")
    if "box" in parts:
        found["box"] = [box_case(tile_w, block_k) for tile_w in (8, 32, 64, 128) for block_k in (64, 128)]
        for row in found["box"]:
            print("box", row, flush=True)
    if "gemm" in parts:
        # INT8 only with the dropped tiles: Triton waits for each of its wgmmas at once.
        cases = [(fmt, tile, tile_w, first) for fmt, tiles in (("fp8", DROPPED + KEPT), ("int8", DROPPED))
                 for tile in tiles for tile_w in (32, tile[0]) for first in (True, False)]
        cases += [("fp8", tile, tile_w, True) for tile in ISOLATION for tile_w in (32, 128)]
        cases += [("fp8", DROPPED[0], tile_w, True) for tile_w in (8, 16, 64)]
        found["gemm"] = []
        for case in cases:
            try:
                found["gemm"].append(gemm_case(*case))
            except Exception as error:  # a variant Triton cannot compile: recorded, the others still run
                found["gemm"].append({"case": case, "error": str(error)[:500]})
            print("gemm", found["gemm"][-1], flush=True)
    if "conv" in parts:
        found["conv"] = []
        for fmt in FORMATS:
            for tile in DROPPED + KEPT:
                for width in (20, 40, 200):
                    found["conv"].append(conv_case(fmt, tile, width))
                    print("conv", found["conv"][-1], flush=True)
    if "speed" in parts:
        found["speed"] = []
        for channels, size in ((320, 128), (640, 64), (1280, 32)):
            for tile in DROPPED + KEPT:
                if channels % tile[2] == 0:
                    found["speed"].append(speed_case(tile, channels, size))
                    print("speed", found["speed"][-1], flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
