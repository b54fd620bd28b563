"""The FP8 convolution (torch.ops.sdquant.fp8_conv2d): its two Triton kernels run here in Triton's
interpreter, on the CPU, against the op's twin (the dequantized convolution), on the cases that
take each kernel's every branch; and which layers the conversion gives the kernel. On the GPU:
test_fp8_conv_gpu.py. A whole converted UNet against fake quantization: test_torch_backend.py."""

from __future__ import annotations

import importlib

import pytest
import torch

from sdquant.runtime.kernels import fp8_conv
from sdquant.runtime.kernels.fp8 import fp8_scales, to_fp8
from sdquant.runtime.kernels.fp8_layers import Fp8Conv2d, Fp8RoundedConv2d
from sdquant.runtime.torch_backend import _fp8_layer


@pytest.fixture(scope="module")
def interpreted():
    """The kernels' module compiled for Triton's interpreter, with tiles small enough for it."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    from sdquant.runtime.kernels import fp8_conv_triton

    kernels = importlib.reload(fp8_conv_triton)
    # One configuration each, so the autotuner has nothing to time.
    kernels.tiled.configs = kernels._configs(((32, 32, 64, 4, 2),), kernels._set_blocks)
    kernels.gathered.configs = kernels._configs(((32, 32, 32, 4, 2),))
    yield kernels
    mp.undo()
    # Compiled kernels again for whatever runs next in this process (a GPU's tests).
    importlib.reload(fp8_conv_triton)


def _case(batch, in_channels, out_channels, height, width, kernel, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, in_channels, height, width, generator=generator)
    weight = torch.randn(out_channels, kernel, kernel, in_channels, generator=generator) * 0.1
    (x_inverse, x_scale), (w_inverse, w_scale) = fp8_scales(x.abs().amax()), fp8_scales(weight.abs().amax())
    return to_fp8(x, x_inverse), to_fp8(weight, w_inverse), x_scale, w_scale, torch.randn(out_channels, generator=generator)


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


@pytest.mark.parametrize("name", list(CASES))
def test_each_triton_kernel_computes_the_dequantized_convolution(interpreted, name):
    (batch, cin, cout, height, width, kernel, stride, padding, channels_last, bias), tiled = CASES[name]
    x, weight, x_scale, w_scale, bias_values = _case(batch, cin, cout, height, width, kernel)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    bias_values = bias_values if bias else None
    assert interpreted._tiled_fits(x, stride) == tiled
    got = interpreted.triton_conv2d(x, weight, x_scale, w_scale, bias_values, stride, padding,
                                    fp8_conv.conv_output(x, weight, stride, padding, torch.float32))
    expected = fp8_conv.reference_conv2d(x, weight, x_scale, w_scale, bias_values, stride, padding, torch.float32)
    assert got.shape == expected.shape and got.stride() == expected.stride()
    # Both sum the same exact products in fp32, in another order: a wrong tap, border or channel
    # strip is off by the size of the output.
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-5


def test_the_kernel_takes_plain_convolutions_and_the_rest_stay_rounded():
    def layer(**kwargs):
        conv = torch.nn.Conv2d(**{"in_channels": 64, "out_channels": 32, "kernel_size": 3, "padding": 1, **kwargs})
        return _fp8_layer(conv, {"weight": conv.weight.detach().abs().amax(), "input": torch.tensor(4.0)})

    assert isinstance(layer(), Fp8Conv2d)
    assert isinstance(layer(stride=2), Fp8Conv2d)
    for refused in ({"groups": 2}, {"dilation": 2}, {"stride": (1, 2)}, {"padding": "same"}, {"in_channels": 48},
                    {"padding_mode": "reflect"}):
        assert isinstance(layer(**refused), Fp8RoundedConv2d), refused
