"""The 8-bit convolutions' Triton kernels (torch.ops.sdquant.fp8_conv2d and int8_conv2d on CUDA)
against each op's twin (sdquant.runtime.kernels.conv8, run on the same GPU tensors): at SDXL's
channel counts, through both kernels, with every tile the autotuner may pick at every depth of
SDXL's UNet and every resolution bucket, and on every converted convolution of the SDXL scene
model on its own input, in both formats. FP8 cases are skipped on a GPU without FP8 tensor cores
(below sm89), INT8 ones below Ampere (sm80).

    python -m pytest -m gpu tests/test_conv8_gpu.py -n 0 -s

The kernels multiply exact 8-bit products and apply the scales once to the sum (fp32 for FP8,
exact int32 for INT8); the twin dequantizes each value to fp16 first (a rounding of up to 2**-11
of it) and convolves in fp16 with fp32 sums. On random data FP8 differs by 1-3e-3 of the output's
norm (H100); a wrong tap, border, channel strip or scale is off by the size of the output.
"""

from __future__ import annotations

import pytest
import torch

from sdquant.runtime import torch_backend
from sdquant.runtime.kernels.fp8_layers import Fp8Conv2d, fp8_kernels_missing
from sdquant.runtime.kernels.int8 import MIN_CONV_CAPABILITY, Int8Conv2d

from conftest import FAST_QUANTIZE, compose_config, restored_backbones
from test_conv8 import TWINS, _quantized

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none is visible here)")]

CUDA = torch.device("cuda")
TWIN_BOUND = 1e-2
FORMATS = ["fp8", "int8"]
OPS = {"fp8": "fp8_conv2d", "int8": "int8_conv2d"}


def _needs_kernels(fmt: str) -> None:
    """Skips `fmt` on a GPU without its tensor cores; fails where the kernels should run and cannot."""
    if fmt == "int8":
        if torch.cuda.get_device_capability(CUDA) < MIN_CONV_CAPABILITY:
            pytest.skip("INT8 convolution kernels need an Ampere or newer GPU (sm80+)")
        return
    missing = fp8_kernels_missing(CUDA)
    if missing and "sm89" in missing:
        pytest.skip(missing)
    assert missing is None, missing


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _compare(fmt, x, weight, x_scale, weight_scale, bias, stride, padding, what: str) -> float:
    got = getattr(torch.ops.sdquant, OPS[fmt])(x, weight, x_scale, weight_scale, bias, stride, padding, torch.float16)
    twin = TWINS[fmt](x, weight, x_scale, weight_scale, bias, stride, padding, torch.float16)
    assert got.shape == twin.shape and got.stride() == twin.stride(), what
    error = _relative(got, twin)
    print(f"{fmt} {what}: kernel against twin {error:.1e}")
    assert error < TWIN_BOUND, what
    return error


def _random_case(fmt, samples, cin, cout, height, width, kernel, seed):
    generator = torch.Generator(CUDA).manual_seed(seed)
    x = torch.randn(samples, cin, height, width, device=CUDA, generator=generator, dtype=torch.float16)
    weight = torch.randn(cout, kernel, kernel, cin, device=CUDA, generator=generator, dtype=torch.float16) * 0.05
    return _quantized(fmt, x.contiguous(memory_format=torch.channels_last), weight)


# (samples, in, out channels, height, width, kernel, stride, padding, channels-last): SDXL's UNet
# layers at a small image, a row wider than the largest tile (the VAE's), a 1x1 filter, stride 2
# and channels-first memory (the gathered kernel).
SHAPES = [(4, 320, 320, 32, 32, 3, 1, 1, True), (2, 640, 1280, 16, 16, 3, 1, 1, True),
          (2, 960, 320, 32, 32, 3, 1, 1, True), (1, 256, 128, 8, 300, 3, 1, 1, True),
          (2, 640, 320, 16, 16, 1, 1, 0, True), (2, 320, 320, 32, 32, 3, 2, 1, True),
          (2, 320, 640, 24, 20, 3, 1, 1, False)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=[str(shape) for shape in SHAPES])
def test_kernel_matches_its_twin(shape, fmt):
    _needs_kernels(fmt)
    samples, cin, cout, height, width, kernel, stride, padding, channels_last = shape
    x, weight, x_scale, w_scale = _random_case(fmt, samples, cin, cout, height, width, kernel, seed=0)
    if not channels_last:
        x = x.contiguous()
    bias = torch.randn(cout, device=CUDA, generator=torch.Generator(CUDA).manual_seed(1), dtype=torch.float16)
    _compare(fmt, x, weight, x_scale, w_scale, bias, stride, padding, str(shape))


def _every_tile():
    from sdquant.runtime.kernels import conv8_triton as kernels

    return [("tiled", tile) for tile in kernels.TILED_TILES] + [("gathered", tile) for tile in kernels.GATHERED_TILES]


# SDXL's resolution buckets (width, height), each generated as it is and transposed.
SDXL_BUCKETS = ((1024, 1024), (1152, 896), (1216, 832), (1344, 768), (1536, 640))
# (channels, the image's size over the feature map's) at each depth of SDXL's UNet: the latent and
# the two down blocks below it.
UNET_DEPTHS = ((320, 8), (640, 16), (1280, 32))
# The stride of the convolution that takes each kernel in SDXL's UNet: a ResNet block's 3x3 the
# tiled one, a downsampler's 3x3 the gathered one (below the last down block, where SDXL has none,
# it stands for any input the tiled kernel refuses).
STRIDES = {"tiled": 1, "gathered": 2}


def _tile_bound(fmt: str, reduction: int) -> float:
    """How far a right tile may be from the twin in fp64 over sums of `reduction` products. INT8's
    sums are exact: only the fp16 output's rounding parts them (2.1e-4 on an H100). FP8's fast
    accumulation adds an error that grows as the square root of the reduction (1.1e-3 at 2880
    products, 1.6e-3 at 5760, 2.5e-3 at 11520, alike for every tile). Tiles whose sums raced were
    off by 6e-3 to 0.2 at 2304 (benchmarks/conv8_tile_repro.py)."""
    return 1e-3 if fmt == "int8" else 4e-5 * reduction ** 0.5


def _feature_maps(factor: int) -> list[tuple[int, int]]:
    """(height, width) at 1/`factor` of every bucket and its transpose."""
    sizes = [(height // factor, width // factor) for width, height in SDXL_BUCKETS]
    return list(dict.fromkeys(sizes + [(width, height) for height, width in sizes]))


def _only(kernels, kernel: str, tile: tuple) -> None:
    """Leaves `kernel`'s autotuner `tile` alone to run."""
    autotuner = getattr(kernels, kernel)
    autotuner.configs = kernels._configs((tile,), kernels._set_blocks if kernel == "tiled" else None)
    autotuner.cache = {}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("channels,factor", UNET_DEPTHS, ids=[f"{c}ch" for c, _ in UNET_DEPTHS])
def test_every_tile_of_each_kernel_matches_the_twin_at_sdxl_sizes(channels, factor, fmt):
    """The autotuner picks a tile per shape by speed alone: each must be right wherever it may be
    picked. At one depth of SDXL's UNet, for every resolution bucket and its transpose, two samples
    (classifier-free guidance), every tile whose channel step divides the channels (the only ones
    the autotuner offers there). Feature maps narrower than a tile give tiles of several image
    rows, wider ones tiles that overhang the right edge."""
    from sdquant.runtime.kernels import conv8_triton as kernels

    _needs_kernels(fmt)
    names = [name for name in STRIDES if name == "gathered" or torch.cuda.get_device_capability(CUDA)[0] >= 9]
    offered = {name: getattr(kernels, name).configs for name in names}
    wrong = []
    try:
        for height, width in _feature_maps(factor):
            x, weight, x_scale, w_scale = _random_case(fmt, 2, channels, channels, height, width, 3, seed=height)
            for name in names:
                args = (x, weight, x_scale, w_scale, None, STRIDES[name], 1)
                assert kernels._tiled_fits(x, STRIDES[name]) == (name == "tiled")
                twin = TWINS[fmt](*args, torch.float64)
                for tile in [tile for kernel, tile in _every_tile() if kernel == name and channels % tile[2] == 0]:
                    _only(kernels, name, tile)
                    error = _relative(getattr(torch.ops.sdquant, OPS[fmt])(*args, torch.float16), twin)
                    print(f"{fmt} {name} {tile} {channels}x{height}x{width}: against the fp64 twin {error:.1e}")
                    if error >= _tile_bound(fmt, 9 * channels):
                        wrong.append(f"{name} {tile} at {height}x{width}: {error:.1e}")
    finally:
        for name, configs in offered.items():
            getattr(kernels, name).configs, getattr(kernels, name).cache = configs, {}
    assert not wrong, wrong


@pytest.fixture(scope="module")
def level3(tmp_path_factory):
    """The SDXL scene model quantized at level 3 in each format, made once per format."""
    from sdquant.workflow.quantize import run_quantize

    made = {}

    def checkpoint(fmt: str):
        if fmt not in made:
            made[fmt] = run_quantize(compose_config("sd_xl_quantize", [
                "model=scenes_sdxl", f"out_dir={tmp_path_factory.mktemp('quantized')}", "device=cpu", *FAST_QUANTIZE,
                f"quantize.format={fmt}", "quantize.quant_level=3"]))
        return made[fmt]

    return checkpoint


def converted_scene_inputs(checkpoint, fmt: str, layer_class: type, then=None) -> dict:
    """{name: (layer, its input)} for every `layer_class` layer of the SDXL scene model's UNet
    converted to `fmt`'s kernels on the GPU (and given `then(unet)`'s forms), on one call's inputs."""
    from sdquant.families.sd import SDXL

    (unet,) = restored_backbones("scenes_sdxl", checkpoint).values()
    unet.to(device=CUDA, dtype=torch.float16).eval().to(memory_format=torch.channels_last)
    torch_backend.convert_quantized(unet, SDXL, str(checkpoint), fmt)
    if then is not None:
        then(unet)
    layers = {name: module for name, module in unet.named_modules() if isinstance(module, layer_class)}
    seen = {}

    def keep(name: str):
        def hook(module, args, _out):
            seen.setdefault(name, (module, args[0]))
        return hook

    hooks = [module.register_forward_hook(keep(name)) for name, module in layers.items()]
    generator = torch.Generator(CUDA).manual_seed(0)
    with torch.no_grad():
        SDXL.backbone_stage(unet, torch.float16)(
            x=torch.randn(2, 4, 16, 16, device=CUDA, generator=generator).half(),
            timesteps=torch.full((2,), 700.0, device=CUDA),
            context=torch.randn(2, 77, 192, device=CUDA, generator=generator).half(),
            y=torch.randn(2, 176, device=CUDA, generator=generator).half())
    for hook in hooks:
        hook.remove()
    assert seen.keys() == layers.keys()
    return seen


@pytest.mark.parametrize("fmt,layer_class", [("fp8", Fp8Conv2d), ("int8", Int8Conv2d)])
def test_every_converted_scene_convolution_matches_its_twin_on_its_own_input(level3, fmt, layer_class):
    _needs_kernels(fmt)
    seen = converted_scene_inputs(level3(fmt), fmt, layer_class)
    assert len(seen) > 10
    with torch.no_grad():
        for name, (module, x) in seen.items():
            _compare(fmt, *module.operands(x), module.bias, module.stride, module.padding, f"{name} {tuple(x.shape)}")
