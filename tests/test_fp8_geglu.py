"""The fused FP8 GEGLU (torch.ops.sdquant.fp8_geglu): its Triton kernel run here in Triton's interpreter,
on the CPU, against its twin; which feed-forward layers the torch backend gives it; and that a
layer given it computes what its unfused FP8 layers computed. On the GPU: test_fp8_geglu_gpu.py.
A whole converted UNet with it: test_torch_backend.py."""

from __future__ import annotations

import importlib

import pytest
import torch
from diffusers.models.attention import FeedForward

from sdquant.runtime.kernels.fp8 import fp8_scales, to_fp8
from sdquant.runtime.kernels.fp8_geglu import Fp8Geglu, fuse_geglus, reference_fp8_geglu
from sdquant.runtime.kernels.fp8_layers import Fp8Linear
from sdquant.runtime.kernels.int8 import Int8Linear


def _reload_kernels():
    """The kernel's module and the convolutions' one whose jit helpers it calls, compiled anew (for
    the interpreter while TRITON_INTERPRET is set): an interpreted kernel cannot call a compiled
    helper, which test_conv8.py's fixture leaves behind."""
    from sdquant.runtime.kernels import conv8_triton, fp8_geglu_triton

    importlib.reload(conv8_triton)
    return importlib.reload(fp8_geglu_triton)


@pytest.fixture(scope="module")
def interpreted():
    """The kernel's module compiled for Triton's interpreter, with a tile small enough for it."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    kernels = _reload_kernels()
    # One configuration, so the autotuner has nothing to time.
    kernels.geglu.configs = kernels._configs(((32, 32, 32, 4, 2),))
    yield kernels
    mp.undo()
    # Compiled kernels again for whatever runs next in this process (a GPU's tests).
    _reload_kernels()


# (tokens, in features, features after the gating, bias): tiles that overhang the tokens, the
# features (so a value tile reads gate rows, and a gate tile rows past the weight) and the input
# features (a part strip).
CASES = {"overhanging every tile": (50, 48, 40, True), "no bias": (33, 96, 48, False), "whole tiles": (64, 64, 64, True)}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_computes_the_twins_values_before_their_rounding(interpreted, name):
    tokens, in_features, features, bias = CASES[name]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, in_features, generator=generator)
    weight = torch.randn(2 * features, in_features, generator=generator) * 0.2
    (x_inverse, x_scale), (w_inverse, w_scale) = fp8_scales(x.abs().amax()), fp8_scales(weight.abs().amax())
    bias_values = torch.randn(2 * features, generator=generator) if bias else None
    out_inverse, _ = fp8_scales(torch.tensor(3.0))
    args = (to_fp8(x, x_inverse), to_fp8(weight, w_inverse), x_scale, w_scale, bias_values, out_inverse)
    # An fp32 output takes the values the kernel would round: the interpreter's own FP8 rounding is
    # wrong at the edges of binades (31.9 -> 16), a GPU's is not (test_fp8_geglu_gpu.py).
    values = interpreted.triton_geglu(*args, torch.empty(tokens, features))
    expected = reference_fp8_geglu(*args, torch.float32)
    # The kernel scales exact sums once, the twin sums dequantized products: fp32 rounding apart,
    # which moves a value lying on an FP8 rounding boundary to the next FP8 value (none to 0.1% of
    # them seen); a wrong half, strip or scale moves most (95-97% for the tokens in reverse order).
    flipped = (to_fp8(values, torch.tensor(1.0)).float() != expected.float()).float().mean()
    assert float(flipped) < 0.03


def _fp8_feed_forward(activation_fn: str, seed: int = 0):
    """A diffusers feed-forward layer of width 64 whose two Linear layers run FP8 GEMMs, calibrated
    on the input it returns."""
    torch.manual_seed(seed)
    feed_forward = FeedForward(64, activation_fn=activation_fn).eval()
    x = torch.randn(2, 10, 64)
    projection = feed_forward.net[0].proj
    feed_forward.net[0].proj = Fp8Linear.from_linear(projection, projection.weight.abs().amax(), x.abs().amax())
    with torch.no_grad():
        hidden = feed_forward.net[0](x)
    out = feed_forward.net[2]
    feed_forward.net[2] = Fp8Linear.from_linear(out, out.weight.abs().amax(), hidden.abs().amax())
    return feed_forward, x


def test_a_fused_geglu_computes_what_its_fp8_layers_computed():
    feed_forward, x = _fp8_feed_forward("geglu")
    with torch.no_grad():
        expected = feed_forward(x)
        assert fuse_geglus(feed_forward) == 1
        assert isinstance(feed_forward.net[0], Fp8Geglu)
        fused = feed_forward(x)
    # The same twin computations in the same precision, the rounding to FP8 moved into the op.
    assert torch.equal(fused, expected)


def test_only_geglus_between_two_fp8_layers_are_fused():
    tanh_gelu, _ = _fp8_feed_forward("gelu-approximate")
    assert fuse_geglus(tanh_gelu) == 0
    unquantized_reader, _ = _fp8_feed_forward("geglu")
    reader = unquantized_reader.net[2]
    unquantized_reader.net[2] = torch.nn.Linear(reader.in_features, reader.out_features)
    assert fuse_geglus(unquantized_reader) == 0
    int8 = FeedForward(64, activation_fn="geglu").eval()
    int8.net[0].proj = Int8Linear(int8.net[0].proj, int8.net[0].proj.weight.abs().amax(dim=1, keepdim=True),
                                  torch.tensor(4.0), None)
    assert fuse_geglus(int8) == 0
