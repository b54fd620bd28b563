"""The Triton kernels of torch.ops.sdquant.fp8_conv2d and int8_conv2d (sdquant.runtime.kernels.conv8):
implicit-GEMM 8-bit convolutions on tensor cores, FP8 products summed in fp32 and INT8 products in
int32 (exactly), the scales and the bias applied once at the end.

tiled: stride 1 on Hopper. Each program computes a rectangle of output pixels of one sample by a
strip of output channels; for each filter tap it reads the rectangle of input pixels shifted by
the tap as one TMA box, which fills what lies outside the image with zeros, so the padding costs
nothing. gathered: any stride and memory layout, and GPUs without TMA (Ada's FP8, Ampere's INT8):
each program gathers its output pixels' input pixels per tap through pointers, masked at the borders.

Weights are (out channels, kernel rows, kernel columns, in channels): an output channel's filter is
one GEMM row read along the reduction, as Hopper's 8-bit tensor cores take it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

# Autotuned tiles: (output pixels, output channels, input channels per step, warps, pipeline stages).
# Measured for FP8 on an H100 at SDXL's UNet and VAE shapes (benchmarks/conv8_speed.py): the large tiles
# win at 640 channels and more, the 64-channel steps at 320 and 960, 128 pixels by 256 channels
# where 1280 come out of a 32x32 or 64x64 map (benchmarks/results/conv8_speed_unet_fp8_h100.json).
# 128 by 128 channels in 128-channel steps is right too, but was the fastest at none of the UNet's
# shapes at 8 images. tests/test_conv8_gpu.py runs every tile listed here against the twin, in
# both formats, at SDXL's resolutions.
TILED_TILES = ((256, 128, 128, 8, 3), (256, 128, 64, 8, 4), (128, 256, 128, 8, 3), (128, 256, 64, 8, 4),
               (128, 128, 64, 4, 4))
GATHERED_TILES = ((128, 256, 128, 8, 3), (256, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 128, 64, 4, 4),
                  (128, 64, 128, 4, 4), (64, 128, 64, 4, 4), (128, 64, 32, 4, 5))


def _configs(tiles, pre_hook=None):
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_warps=warps,
                          num_stages=stages, pre_hook=pre_hook) for m, n, k, warps, stages in tiles]


def _fitting(configs, named_args, **kwargs):
    """The configurations whose channel strip divides the layer's input channels."""
    channels = kwargs.get("IN_CHANNELS", named_args.get("IN_CHANNELS"))
    return [config for config in configs if channels % config.kwargs["BLOCK_K"] == 0]


def _tile_width(block_m: int, width_p2: int) -> int:
    """Output pixels a tile spans along a row: whole rows where the image is narrower than the tile."""
    return min(block_m, width_p2)


def _set_blocks(args: dict) -> None:
    """Gives the tensor descriptors the boxes of the configuration being run."""
    tile_w = _tile_width(args["BLOCK_M"], args["WIDTH_P2"])
    args["x"].block_shape = [1, args["BLOCK_M"] // tile_w, tile_w, args["BLOCK_K"]]
    args["weight"].block_shape = [args["BLOCK_N"], args["BLOCK_K"]]


_SHAPE_KEY = ["out_channels", "IN_CHANNELS", "KERNEL_H", "KERNEL_W", "PADDING", "INTEGER"]
# Arguments that only count pixels and tiles: one compiled kernel serves every value. Triton would
# compile one for the values 16 divides and one for the others, so each new resolution (SDXL's
# buckets and their transposes) would compile anew every tile the autotuner tries. Strides and
# channel counts stay specialized: they align the loads and stores.
_ANY_SIZE = ["batch", "height", "width", "out_h", "out_w"]


# The kernels use no function of Triton's standard library (tl.cdiv, tl.zeros): those are jit
# functions themselves, which Triton's interpreter (the CPU tests) cannot call when triton was
# imported before the interpreter was switched on.
@triton.jit
def _ceil_div(a, b):
    return (a + b - 1) // b


@triton.jit
def _grouped(program, row_tiles, col_tiles, GROUP_M: tl.constexpr):
    # Programs walk GROUP_M row tiles down one column of tiles before the next, so a strip of
    # input rows stays in L2 while several weight tiles read it.
    per_group = GROUP_M * col_tiles
    first_row_tile = (program // per_group) * GROUP_M
    group_rows = min(row_tiles - first_row_tile, GROUP_M)
    return first_row_tile + (program % per_group) % group_rows, (program % per_group) // group_rows


@triton.jit
def _epilogue(sums, x_scale, weight_scale, bias, out, rows, row_valid, cols, out_channels, HAS_BIAS: tl.constexpr,
              INTEGER: tl.constexpr):
    col_valid = cols < out_channels
    if INTEGER:
        # INT8: the scale arguments hold divisors (127 / amax), the weight's one per output
        # channel, so one unit of the exact sum is worth 1 / (both divisors).
        unit = 1 / (tl.load(x_scale) * tl.load(weight_scale + cols, mask=col_valid, other=1.0))
        result = sums.to(tl.float32) * unit[None, :]
    else:
        result = sums * (tl.load(x_scale) * tl.load(weight_scale))
    if HAS_BIAS:
        result += tl.load(bias + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    # The output is channels-last: row = pixel, column = channel.
    targets = out + rows.to(tl.int64)[:, None] * out_channels + cols[None, :]
    tl.store(targets, result.to(out.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


@triton.autotune(configs=_configs(TILED_TILES, _set_blocks), key=["batch", "out_h", "out_w", *_SHAPE_KEY],
                 prune_configs_by={"early_config_prune": _fitting})
@triton.jit(do_not_specialize=_ANY_SIZE)
def tiled(x, weight, bias, out, x_scale, weight_scale, batch, out_h, out_w, out_channels,
          IN_CHANNELS: tl.constexpr, KERNEL_H: tl.constexpr, KERNEL_W: tl.constexpr, STRIDE: tl.constexpr,
          PADDING: tl.constexpr, HAS_BIAS: tl.constexpr, INTEGER: tl.constexpr, WIDTH_P2: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    TILE_W: tl.constexpr = BLOCK_M if WIDTH_P2 >= BLOCK_M else WIDTH_P2
    TILE_H: tl.constexpr = BLOCK_M // TILE_W
    tiles_y = _ceil_div(out_h, TILE_H)
    tiles_x = _ceil_div(out_w, TILE_W)
    row_tile, col_tile = _grouped(tl.program_id(0), batch * tiles_y * tiles_x, _ceil_div(out_channels, BLOCK_N),
                                  GROUP_M)
    sample = row_tile // (tiles_y * tiles_x)
    y0 = (row_tile // tiles_x) % tiles_y * TILE_H
    x0 = row_tile % tiles_x * TILE_W
    col0 = col_tile * BLOCK_N
    # Channels by pixels: the box is the dot's second operand, which Hopper's tensor cores read from
    # shared memory, where TMA put it. As the first operand, a box of several image rows (a reshape
    # Triton 3.6 does not fold into the load) went through registers, and the next step's loads
    # overwrote them while the last step's wgmmas still read them (ptxas before CUDA 13.3,
    # triton-lang/triton#9433): sums up to 20% off, as timing had it (benchmarks/conv8_tile_repro.py).
    sums = tl.full((BLOCK_N, BLOCK_M), 0, tl.int32 if INTEGER else tl.float32)
    for k in range(0, KERNEL_H * KERNEL_W * IN_CHANNELS, BLOCK_K):
        tap = k // IN_CHANNELS
        box = x.load([sample, y0 - PADDING + tap // KERNEL_W, x0 - PADDING + tap % KERNEL_W, k % IN_CHANNELS])
        sums = tl.dot(weight.load([col0, k]), box.reshape(BLOCK_M, BLOCK_K).T, sums, out_dtype=sums.dtype)
    pixel = tl.arange(0, BLOCK_M)
    out_y = y0 + pixel // TILE_W
    out_x = x0 + pixel % TILE_W
    rows = (sample * out_h + out_y) * out_w + out_x
    _epilogue(sums.T, x_scale, weight_scale, bias, out, rows, (out_y < out_h) & (out_x < out_w),
              col0 + tl.arange(0, BLOCK_N), out_channels, HAS_BIAS, INTEGER)


@triton.autotune(configs=_configs(GATHERED_TILES), key=["batch", "height", "width", "STRIDE", *_SHAPE_KEY],
                 prune_configs_by={"early_config_prune": _fitting})
@triton.jit(do_not_specialize=_ANY_SIZE)
def gathered(x, weight, bias, out, x_scale, weight_scale, batch, height, width, out_h, out_w, out_channels,
             x_stride_n, x_stride_c, x_stride_h, x_stride_w, IN_CHANNELS: tl.constexpr, KERNEL_H: tl.constexpr,
             KERNEL_W: tl.constexpr, STRIDE: tl.constexpr, PADDING: tl.constexpr, HAS_BIAS: tl.constexpr,
             INTEGER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             GROUP_M: tl.constexpr):
    pixels = batch * out_h * out_w
    row_tile, col_tile = _grouped(tl.program_id(0), _ceil_div(pixels, BLOCK_M), _ceil_div(out_channels, BLOCK_N),
                                  GROUP_M)
    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    strip = tl.arange(0, BLOCK_K)
    row_valid = rows < pixels
    out_y = (rows // out_w) % out_h
    out_x = rows % out_w
    x_rows = x + (rows // (out_h * out_w)).to(tl.int64) * x_stride_n
    filters = weight + cols.to(tl.int64) * (KERNEL_H * KERNEL_W * IN_CHANNELS)
    col_valid = cols < out_channels
    sums = tl.full((BLOCK_M, BLOCK_N), 0, tl.int32 if INTEGER else tl.float32)
    for k in range(0, KERNEL_H * KERNEL_W * IN_CHANNELS, BLOCK_K):
        tap = k // IN_CHANNELS
        # Without the hint the compiler cannot prove a strip starts 16-byte aligned and loads it
        # a byte at a time (0.4x of fp16 on an H100 instead of 1.4-2x).
        channel = tl.multiple_of(k % IN_CHANNELS, BLOCK_K)
        in_y = out_y * STRIDE - PADDING + tap // KERNEL_W
        in_x = out_x * STRIDE - PADDING + tap % KERNEL_W
        inside = row_valid & (in_y >= 0) & (in_y < height) & (in_x >= 0) & (in_x < width)
        pixel = x_rows + in_y.to(tl.int64) * x_stride_h + in_x.to(tl.int64) * x_stride_w
        a = tl.load(pixel[:, None] + (channel + strip)[None, :] * x_stride_c, mask=inside[:, None], other=0.0)
        b = tl.load(filters[None, :] + (k + strip)[:, None], mask=col_valid[None, :], other=0.0)
        sums = tl.dot(a, b, sums, out_dtype=sums.dtype)
    _epilogue(sums, x_scale, weight_scale, bias, out, rows, row_valid, cols, out_channels, HAS_BIAS, INTEGER)


def _tiled_fits(x: torch.Tensor, stride: int) -> bool:
    """Whether the TMA kernel reads `x`: stride 1, channels-last memory, channels in its strips, on
    Hopper or newer (TMA)."""
    return (stride == 1 and x.is_contiguous(memory_format=torch.channels_last)
            and x.shape[1] % min(tile[2] for tile in TILED_TILES) == 0
            and (not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] >= 9))


def triton_conv2d(x, weight, x_scale, weight_scale, bias, stride, padding, out):
    """Either op into `out` (channels-last), on `x`'s device (a CPU under TRITON_INTERPRET=1, as the
    CPU tests run it): FP8 `x` and `weight` with their scales, or INT8 ones with their divisors (the
    weight's one per output channel)."""
    batch, in_channels, height, width = x.shape
    out_channels, kernel_h, kernel_w, _ = weight.shape
    _, _, out_h, out_w = out.shape
    common = dict(IN_CHANNELS=in_channels, KERNEL_H=kernel_h, KERNEL_W=kernel_w, STRIDE=stride, PADDING=padding,
                  HAS_BIAS=bias is not None, INTEGER=x.dtype == torch.int8)
    bias = bias if bias is not None else x_scale
    # Both kernels read each filter as one contiguous row.
    weight = weight.contiguous()
    if _tiled_fits(x, stride):
        width_p2 = triton.next_power_of_2(out_w)
        nhwc = x.permute(0, 2, 3, 1)
        filters = weight.reshape(out_channels, -1)
        # The canonical channels-last strides: a tensor of one pixel counts as contiguous in either
        # layout and may carry channels-first ones, which TMA refuses. Boxes are set per
        # configuration (_set_blocks).
        x_box = TensorDescriptor(nhwc, list(nhwc.shape), [height * width * in_channels, width * in_channels,
                                                          in_channels, 1], [1, 1, 1, 16])
        weight_box = TensorDescriptor(filters, list(filters.shape), list(filters.stride()), [16, 16])

        def grid(meta):
            tile_w = _tile_width(meta["BLOCK_M"], width_p2)
            tiles = triton.cdiv(out_h, meta["BLOCK_M"] // tile_w) * triton.cdiv(out_w, tile_w)
            return (batch * tiles * triton.cdiv(out_channels, meta["BLOCK_N"]),)

        tiled[grid](x_box, weight_box, bias, out, x_scale, weight_scale, batch, out_h, out_w, out_channels,
                    WIDTH_P2=width_p2, **common)
    else:
        def grid(meta):
            return (triton.cdiv(batch * out_h * out_w, meta["BLOCK_M"]) * triton.cdiv(out_channels, meta["BLOCK_N"]),)

        gathered[grid](x, weight, bias, out, x_scale, weight_scale, batch, height, width, out_h, out_w, out_channels,
                       *x.stride(), **common)
    return out
