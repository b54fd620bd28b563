"""The FP8 convolution kernel (sdquant.runtime.kernels.fp8_conv, Triton implicit GEMM) against torch's
fp16 channels-last convolution (cuDNN), kernel time only, at every convolution shape the FP8 recipe
quantizes in the full-size SDXL UNet (3x3 convolutions in ResNet blocks, down- and upsamplers;
not conv_in, conv_out and the 1x1 shortcuts, which stay 16-bit) at 8 images per call (16 samples
with guidance) and at every 3x3 convolution of SDXL's VAE decoder at 8 images. Random full-size
weights; shapes are recorded from one real forward of each network. Each shape: median of
triton.testing.do_bench, the kernel's error against its twin (the dequantized convolution), and
the UNet's total per call weighted by how often each shape runs. Needs a CUDA GPU with FP8 (sm89+).

    python benchmarks/fp8_conv_speed.py --out benchmarks/results/fp8_conv_h100.json
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch

from sdquant import report
from sdquant.runtime.kernels.fp8 import fp8_scales, to_fp8
from sdquant.runtime.kernels.fp8_conv import fp8_conv2d, reference_conv2d

# The recipe's convolutions in 16 bits (sdquant.families.sd.HIGH_PRECISION).
UNQUANTIZED = ("conv_in", "conv_out", "conv_shortcut")


def conv_shapes(module: torch.nn.Module, run, skip=()) -> Counter:
    """(in channels, out channels, kernel, stride, padding, input batch, height, width) -> calls,
    for every Conv2d of `module` that `run` reaches, except those whose name holds one of `skip`."""
    seen = Counter()
    hooks = []
    for name, layer in module.named_modules():
        if isinstance(layer, torch.nn.Conv2d) and not any(part in name for part in skip):
            def record(layer, args, _out):
                batch, channels, height, width = args[0].shape
                seen[(channels, layer.out_channels, layer.kernel_size[0], layer.stride[0], layer.padding[0], batch,
                      height, width)] += 1
            hooks.append(layer.register_forward_hook(record))
    with torch.no_grad():
        run()
    for hook in hooks:
        hook.remove()
    return seen


def network_shapes(batch: int) -> dict[str, Counter]:
    """The quantized convolution shapes of the full-size SDXL UNet at `batch` images per call (twice
    as many samples) and of its VAE decoder's 3x3 convolutions."""
    from sdquant.families.sdxl import SDXL

    pipe = SDXL.full_size_on_gpu()
    samples = 2 * batch
    latents = torch.randn(samples, 4, 128, 128, device="cuda", dtype=torch.float16)
    context = torch.randn(samples, 77, 2048, device="cuda", dtype=torch.float16)
    added = {"text_embeds": torch.randn(samples, 1280, device="cuda", dtype=torch.float16),
             "time_ids": torch.zeros(samples, 6, device="cuda", dtype=torch.float16)}
    unet = conv_shapes(pipe.unet, lambda: pipe.unet(latents, 500, context, added_cond_kwargs=added), skip=UNQUANTIZED)
    vae = conv_shapes(pipe.vae.decoder, lambda: pipe.vae.decode(latents[:batch]), skip=UNQUANTIZED)
    del pipe
    torch.cuda.empty_cache()
    return {"unet": unet, "vae": Counter({shape: calls for shape, calls in vae.items() if shape[2] == 3})}


def measure(shape: tuple) -> dict:
    import triton.testing

    in_channels, out_channels, kernel, stride, padding, batch, height, width = shape
    x = torch.randn(batch, in_channels, height, width, device="cuda", dtype=torch.float16)
    x = x.contiguous(memory_format=torch.channels_last)
    conv = torch.nn.Conv2d(in_channels, out_channels, kernel, stride, padding, device="cuda", dtype=torch.float16)
    conv = conv.to(memory_format=torch.channels_last)
    x_inverse, x_scale = (s.cuda() for s in fp8_scales(x.abs().amax()))
    w_inverse, w_scale = (s.cuda() for s in fp8_scales(conv.weight.abs().amax()))
    x_fp8 = to_fp8(x, x_inverse)
    w_fp8 = to_fp8(conv.weight.detach().permute(0, 2, 3, 1).contiguous(), w_inverse)
    bias = conv.bias.detach()

    def fp8():
        return fp8_conv2d(x_fp8, w_fp8, x_scale, w_scale, bias, stride, padding, torch.float16)

    with torch.no_grad():
        fp16_ms = triton.testing.do_bench(lambda: conv(x))
        fp8_ms = triton.testing.do_bench(fp8)
        twin = reference_conv2d(x_fp8, w_fp8, x_scale, w_scale, bias, stride, padding, torch.float16).float()
        error = ((fp8().float() - twin).norm() / twin.norm()).item()
    out_h = (height + 2 * padding - kernel) // stride + 1
    out_w = (width + 2 * padding - kernel) // stride + 1
    tflop = 2 * batch * out_h * out_w * out_channels * in_channels * kernel * kernel / 1e12
    return {"in_channels": in_channels, "out_channels": out_channels, "kernel": kernel, "stride": stride,
            "batch": batch, "height": height, "width": width, "fp16_ms": fp16_ms, "fp8_ms": fp8_ms,
            "speed_up": fp16_ms / fp8_ms, "fp16_tflops": tflop / fp16_ms * 1e3, "fp8_tflops": tflop / fp8_ms * 1e3,
            "relative_error_vs_twin": error}


def network_rows(shapes: Counter) -> dict:
    rows = []
    for shape, calls in sorted(shapes.items()):
        row = measure(shape)
        row["calls"] = calls
        rows.append(row)
        print(f"{shape}: x{calls} fp16 {row['fp16_ms']:.3f} ms ({row['fp16_tflops']:.0f} TFLOP/s), FP8 "
              f"{row['fp8_ms']:.3f} ms ({row['fp8_tflops']:.0f}), {row['speed_up']:.2f}x, "
              f"error {row['relative_error_vs_twin']:.1e}", flush=True)
    fp16_total = sum(row["fp16_ms"] * row["calls"] for row in rows)
    fp8_total = sum(row["fp8_ms"] * row["calls"] for row in rows)
    return {"shapes": rows, "fp16_ms_per_call": fp16_total, "fp8_ms_per_call": fp8_total,
            "speed_up": fp16_total / fp8_total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="images per call (the UNet sees twice as many)")
    parser.add_argument("--networks", default="unet,vae")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    measured = {"benchmark": "fp8_conv_speed", "device": torch.cuda.get_device_name(), "versions": report.library_versions(),
                "images_per_call": args.batch}
    shapes = network_shapes(args.batch)
    for network in args.networks.split(","):
        measured[network] = network_rows(shapes[network])
        print(f"{network}: fp16 {measured[network]['fp16_ms_per_call']:.2f} ms per call, FP8 "
              f"{measured[network]['fp8_ms_per_call']:.2f} ms, {measured[network]['speed_up']:.2f}x", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(measured, indent=1))


if __name__ == "__main__":
    main()
