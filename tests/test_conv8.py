"""The 8-bit convolutions (torch.ops.sdquant.fp8_conv2d and int8_conv2d): their two Triton kernels run
here in Triton's interpreter, on the CPU, in both formats, against each op's twin (the dequantized
convolution), on the cases that take each kernel's every branch; and which layers the conversion
gives the kernels. On the GPU: test_conv8_gpu.py. A whole converted UNet against fake quantization:
test_torch_backend.py (FP8) and test_int8_gemm.py (INT8)."""

from __future__ import annotations

import importlib

import pytest
import torch

from sdquant.runtime.kernels import conv8
from sdquant.runtime.kernels.fp8 import fp8_scales, to_fp8
from sdquant.runtime.kernels.fp8_layers import Fp8Conv2d, Fp8RoundedConv2d
from sdquant.runtime.kernels.int8 import Int8Conv2d, Int8RoundedConv2d, int8_scales, to_int8
from sdquant.runtime.torch_backend import _fp8_layer, _int8_layer


@pytest.fixture(scope="module")
def interpreted():
    """The kernels' module compiled for Triton's interpreter, with tiles small enough for it."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    from sdquant.runtime.kernels import conv8_triton

    kernels = importlib.reload(conv8_triton)
    # One configuration each, so the autotuner has nothing to time.
    kernels.tiled.configs = kernels._configs(((32, 32, 64, 4, 2),), kernels._set_blocks)
    kernels.gathered.configs = kernels._configs(((32, 32, 32, 4, 2),))
    yield kernels
    mp.undo()
    # Compiled kernels again for whatever runs next in this process (a GPU's tests).
    importlib.reload(conv8_triton)


def _quantized(fmt, x, weight):
    """`x` and `weight` (out channels, kernel rows, kernel columns, in channels) in 8 bits, with the
    scales the op takes: FP8's per tensor, INT8's divisors (the weight's one per output channel)."""
    if fmt == "fp8":
        (x_inverse, x_scale), (w_inverse, w_scale) = fp8_scales(x.abs().amax()), fp8_scales(weight.abs().amax())
        return to_fp8(x, x_inverse), to_fp8(weight, w_inverse), x_scale, w_scale
    (x_scale, x_divisor), (w_scale, w_divisor) = (int8_scales(x.abs().amax()),
                                                  int8_scales(weight.abs().amax(dim=(1, 2, 3), keepdim=True)))
    return to_int8(x, x_scale), to_int8(weight, w_scale), x_divisor, w_divisor.reshape(-1)


def _case(fmt, batch, in_channels, out_channels, height, width, kernel, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, in_channels, height, width, generator=generator)
    # Output channels of unequal ranges, which INT8's per-channel divisors must each undo.
    weight = torch.randn(out_channels, kernel, kernel, in_channels, generator=generator) * 0.1
    weight = weight * torch.linspace(0.2, 2.0, out_channels).reshape(-1, 1, 1, 1)
    return *_quantized(fmt, x, weight), torch.randn(out_channels, generator=generator)


TWINS = {"fp8": conv8.reference_fp8_conv2d, "int8": conv8.reference_int8_conv2d}


# (batch, in, out channels, height, width, kernel, stride, padding, channels-last, bias), and the kernel
# that takes it: tiles that overhang the image (widths 7 and 40 are no multiple of the tile), a 1x1
# filter, out channels no multiple of the tile, outputs smaller or larger than the input (no or
# extra padding), a one-pixel input (contiguous in both layouts); stride 2, a 96-channel input (no
# whole 64-strip) and a channels-first input take the gathered kernel.
CASES = {
    "3x3, rows narrower than a tile": ((2, 64, 48, 8, 16, 3, 1, 1, True, True), True),
    "3x3, odd width and height": ((1, 64, 40, 5, 7, 3, 1, 1, True, False), True),
    "3x3, a row wider than a tile": ((1, 64, 16, 3, 40, 3, 1, 1, True, True), True),
    "1x1": ((2, 64, 32, 4, 8, 1, 1, 0, True, True), True),
    "3x3 without padding": ((1, 64, 32, 6, 7, 3, 1, 0, True, True), True),
    "1x1 with padding": ((2, 64, 32, 4, 8, 1, 1, 1, True, False), True),
    "one pixel": ((2, 64, 32, 1, 1, 3, 1, 1, True, True), True),
    "3x3 stride 2": ((1, 32, 40, 8, 8, 3, 2, 1, True, True), False),
    "96 channels": ((2, 96, 48, 6, 6, 3, 1, 1, True, True), False),
    "channels-first memory": ((2, 64, 48, 6, 10, 3, 1, 1, False, False), False),
}


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("name", list(CASES))
def test_each_triton_kernel_computes_the_dequantized_convolution(interpreted, name, fmt):
    (batch, cin, cout, height, width, kernel, stride, padding, channels_last, bias), tiled = CASES[name]
    x, weight, x_scale, w_scale, bias_values = _case(fmt, batch, cin, cout, height, width, kernel)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    bias_values = bias_values if bias else None
    assert interpreted._tiled_fits(x, stride) == tiled
    got = interpreted.triton_conv2d(x, weight, x_scale, w_scale, bias_values, stride, padding,
                                    conv8.conv_output(x, weight, stride, padding, torch.float32))
    expected = TWINS[fmt](x, weight, x_scale, w_scale, bias_values, stride, padding, torch.float32)
    assert got.shape == expected.shape and got.stride() == expected.stride()
    # The kernel sums the exact products (in fp32 or int32) and scales once; the twin sums the
    # dequantized products in fp32, in another order: a wrong tap, border, channel strip or
    # channel's divisor is off by the size of the output.
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-5


@pytest.mark.parametrize("fmt,kernel_layer,rounded_layer", [("fp8", Fp8Conv2d, Fp8RoundedConv2d),
                                                            ("int8", Int8Conv2d, Int8RoundedConv2d)])
def test_the_kernels_take_plain_convolutions_and_the_rest_stay_rounded(fmt, kernel_layer, rounded_layer):
    def layer(**kwargs):
        conv = torch.nn.Conv2d(**{"in_channels": 64, "out_channels": 32, "kernel_size": 3, "padding": 1, **kwargs})
        weight_amax = conv.weight.detach().abs().amax(dim=(1, 2, 3), keepdim=True) if fmt == "int8" else None
        convert = _int8_layer if fmt == "int8" else _fp8_layer
        return convert(conv, {"weight": conv.weight.detach().abs().amax() if weight_amax is None else weight_amax,
                              "input": torch.tensor(4.0)})

    assert isinstance(layer(), kernel_layer)
    assert isinstance(layer(stride=2), kernel_layer)
    for refused in ({"groups": 2}, {"dilation": 2}, {"stride": (1, 2)}, {"padding": "same"}, {"in_channels": 48},
                    {"padding_mode": "reflect"}):
        assert isinstance(layer(**refused), rounded_layer), refused

