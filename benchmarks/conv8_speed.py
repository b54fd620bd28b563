"""The 8-bit convolution kernels (sdquant.runtime.kernels.conv8, Triton implicit GEMMs, FP8 and INT8)
against torch's fp16 channels-last convolution (cuDNN), kernel time only, at every convolution shape
the recipes quantize in the full-size SDXL UNet (3x3 convolutions in ResNet blocks, down- and
upsamplers; not conv_in, conv_out and the 1x1 shortcuts, which stay 16-bit) at 8 images per call
(16 samples with guidance) and at every 3x3 convolution of SDXL's VAE decoder at 8 images. Random
full-size weights; shapes are recorded from one real forward of each network. Each shape: median of
triton.testing.do_bench, each kernel's error against its twin (the dequantized convolution), and
the UNet's total per call weighted by how often each shape runs. FP8 needs a GPU with FP8 (sm89+),
INT8 an Ampere or newer one (sm80+).

    python benchmarks/conv8_speed.py --out benchmarks/results/conv8_h100.json
    python benchmarks/conv8_speed.py --formats int8 --out benchmarks/results/conv8_int8_a100.json
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch

from sdquant import report
from sdquant.runtime.kernels.conv8 import fp8_conv2d, int8_conv2d, reference_fp8_conv2d, reference_int8_conv2d
from sdquant.runtime.kernels.fp8_layers import Fp8Conv2d
from sdquant.runtime.kernels.int8 import Int8Conv2d

# The recipe's convolutions in 16 bits (sdquant.families.sd.recipe.HIGH_PRECISION).
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
    from sdquant.families.base import full_size_on_gpu
    from sdquant.families.sd import SDXL

    pipe = full_size_on_gpu(SDXL)
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


# format -> the converted layer, its op and the op's twin; the weight's ranges as each recipe takes
# them (FP8 one per tensor, INT8 one per output channel).
FORMATS = {"fp8": (Fp8Conv2d, fp8_conv2d, reference_fp8_conv2d, lambda weight: weight.abs().amax()),
           "int8": (Int8Conv2d, int8_conv2d, reference_int8_conv2d,
                    lambda weight: weight.abs().amax(dim=(1, 2, 3), keepdim=True))}


def measure(shape: tuple, formats: list[str]) -> dict:
    import triton.testing

    in_channels, out_channels, kernel, stride, padding, batch, height, width = shape
    x = torch.randn(batch, in_channels, height, width, device="cuda", dtype=torch.float16)
    x = x.contiguous(memory_format=torch.channels_last)
    conv = torch.nn.Conv2d(in_channels, out_channels, kernel, stride, padding, device="cuda", dtype=torch.float16)
    conv = conv.to(memory_format=torch.channels_last)
    out_h = (height + 2 * padding - kernel) // stride + 1
    out_w = (width + 2 * padding - kernel) // stride + 1
    tflop = 2 * batch * out_h * out_w * out_channels * in_channels * kernel * kernel / 1e12
    row = {"in_channels": in_channels, "out_channels": out_channels, "kernel": kernel, "stride": stride,
           "batch": batch, "height": height, "width": width}
    with torch.no_grad():
        row["fp16_ms"] = triton.testing.do_bench(lambda: conv(x))
        row["fp16_tflops"] = tflop / row["fp16_ms"] * 1e3
        for fmt in formats:
            layer_class, op, twin, weight_amax = FORMATS[fmt]
            layer = layer_class(conv, weight_amax(conv.weight.detach()), x.abs().amax())
            # The input already rounded: the kernel alone, as the rounding fuses into its producer.
            arguments = (*layer.operands(x), layer.bias, stride, padding, torch.float16)
            row[f"{fmt}_ms"] = triton.testing.do_bench(lambda: op(*arguments))
            row[f"{fmt}_tflops"] = tflop / row[f"{fmt}_ms"] * 1e3
            row[f"{fmt}_speed_up"] = row["fp16_ms"] / row[f"{fmt}_ms"]
            expected = twin(*arguments).float()
            row[f"{fmt}_relative_error_vs_twin"] = ((op(*arguments).float() - expected).norm() / expected.norm()).item()
    return row


def network_rows(shapes: Counter, formats: list[str]) -> dict:
    rows = []
    for shape, calls in sorted(shapes.items()):
        row = measure(shape, formats)
        row["calls"] = calls
        rows.append(row)
        kernels = ", ".join(f"{fmt.upper()} {row[f'{fmt}_ms']:.3f} ms ({row[f'{fmt}_tflops']:.0f}), "
                            f"{row[f'{fmt}_speed_up']:.2f}x, error {row[f'{fmt}_relative_error_vs_twin']:.1e}"
                            for fmt in formats)
        print(f"{shape}: x{calls} fp16 {row['fp16_ms']:.3f} ms ({row['fp16_tflops']:.0f} TFLOP/s); {kernels}", flush=True)
    totals = {f"{kind}_ms_per_call": sum(row[f"{kind}_ms"] * row["calls"] for row in rows)
              for kind in ("fp16", *formats)}
    speed_ups = {f"{fmt}_speed_up": totals["fp16_ms_per_call"] / totals[f"{fmt}_ms_per_call"] for fmt in formats}
    return {"shapes": rows, **totals, **speed_ups}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="images per call (the UNet sees twice as many)")
    parser.add_argument("--networks", default="unet,vae")
    parser.add_argument("--formats", default="fp8,int8", help="the 8-bit kernels to time beside fp16")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    formats = args.formats.split(",")
    unknown = set(formats) - set(FORMATS)
    if unknown:
        parser.error(f"--formats: {', '.join(sorted(unknown))} unknown; choose from {', '.join(FORMATS)}")
    measured = {"benchmark": "conv8_speed", "device": torch.cuda.get_device_name(), "versions": report.library_versions(),
                "images_per_call": args.batch}
    shapes = network_shapes(args.batch)
    for network in args.networks.split(","):
        measured[network] = rows = network_rows(shapes[network], formats)
        kernels = ", ".join(f"{fmt.upper()} {rows[f'{fmt}_ms_per_call']:.2f} ms ({rows[f'{fmt}_speed_up']:.2f}x)"
                            for fmt in formats)
        print(f"{network}: fp16 {rows['fp16_ms_per_call']:.2f} ms per call; {kernels}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(measured, indent=1))


if __name__ == "__main__":
    main()
