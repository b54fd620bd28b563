"""How a trained UNet's activations differ from a random one's: the outliers that SmoothQuant and
Percentile Quant exist for.

Runs the scene model's own pipeline on its calibration prompts twice, once with its trained UNet and
once with a UNet of the same architecture at random initial weights, records the input of every
Conv2d and Linear at every step, and reports per layer kind the median over layers of
- tensor outlier ratio: max |x| over the 99.9th percentile of |x| (how far the extreme values
  stand out from the bulk a per-tensor scale must also resolve);
- channel spread: the largest per-channel max |x| over the median one (what SmoothQuant moves
  into the weights).

    python benchmarks/activation_ranges.py
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from sdquant.config import ModelConfig, shipped_model_folder
from sdquant.load import load_pipeline

REPO = Path(__file__).resolve().parents[1]
KINDS = (("attention q/k/v", ("to_q", "to_k", "to_v")), ("attention out", ("to_out",)),
         ("feed-forward in", ("ff.net.0",)), ("feed-forward out", ("ff.net.2",)),
         ("transformer proj in/out", ("proj_in", "proj_out")), ("resnet time projection", ("time_emb_proj",)),
         ("time/text embedding", ("embedding",)),
         ("resnet/sampler conv", ("conv",)))
# Elements drawn from a layer's input to estimate its 99.9th percentile.
SAMPLE = 1 << 16


def layer_kind(name: str) -> str:
    return next(kind for kind, keys in KINDS + (("other", ("",)),) if any(key in name for key in keys))


class InputRanges:
    """Per layer, the running max of |x| per channel and the mean over calls of p99.9(|x|)."""

    def __init__(self, unet: torch.nn.Module):
        self.channel_max: dict[str, torch.Tensor] = {}
        self.p999: dict[str, list[float]] = defaultdict(list)
        self.generator = torch.Generator().manual_seed(0)
        self.handles = [module.register_forward_pre_hook(self._hook(name)) for name, module in unet.named_modules()
                        if isinstance(module, (torch.nn.Conv2d, torch.nn.Linear))]

    def _hook(self, name: str):
        def record(module, args):
            x = args[0].detach().float().abs()
            channels = x.amax(dim=(0, 2, 3)) if isinstance(module, torch.nn.Conv2d) else x.flatten(0, -2).amax(0)
            previous = self.channel_max.get(name)
            self.channel_max[name] = channels if previous is None else torch.maximum(previous, channels)
            flat = x.flatten()
            drawn = flat[torch.randint(flat.numel(), (min(SAMPLE, flat.numel()),), generator=self.generator)]
            self.p999[name].append(float(torch.quantile(drawn, 0.999)))

        return record

    def per_kind(self) -> dict[str, dict[str, float]]:
        rows = defaultdict(lambda: {"outlier": [], "spread": []})
        for name, channels in self.channel_max.items():
            rows[layer_kind(name)]["outlier"].append(float(channels.max()) / statistics.fmean(self.p999[name]))
            rows[layer_kind(name)]["spread"].append(float(channels.max() / channels.median().clamp_min(1e-12)))
        return {kind: {key: statistics.median(values) for key, values in row.items()} | {"layers": len(row["outlier"])}
                for kind, row in rows.items()}


def measure(pipe, prompts: list[str], steps: int) -> dict:
    ranges = InputRanges(pipe.unet)
    for start in range(0, len(prompts), 8):
        pipe(prompts[start:start + 8], num_inference_steps=steps, guidance_scale=5.0, height=64, width=64,
             generator=torch.Generator().manual_seed(start), output_type="np")
    return ranges.per_kind()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    folder = Path(shipped_model_folder("scenes_sdxl"))
    prompts = (folder / "calib_prompts.txt").read_text().splitlines()[:args.prompts]
    pipe = load_pipeline(ModelConfig(name="scenes_sdxl", family="sdxl", source=str(folder)),
                         torch.device("cpu"), torch.float32)
    trained = measure(pipe, prompts, args.steps)
    torch.manual_seed(0)
    pipe.unet = type(pipe.unet).from_config(pipe.unet.config)
    random = measure(pipe, prompts, args.steps)
    lines = ["# Activation ranges: trained scene UNet against the same UNet at random weights", "",
             f"Inputs of every Conv2d and Linear, {args.prompts} calibration prompts x {args.steps} Euler steps, "
             "guidance 5, 64x64, on the CPU in fp32 (`python benchmarks/activation_ranges.py`). Medians over the "
             "layers of each kind. Outlier ratio: max |x| / 99.9th percentile of |x|. Channel spread: largest "
             "per-channel max |x| / median per-channel max |x|.", "",
             "| layer kind | layers | outlier ratio, trained | outlier ratio, random | channel spread, trained "
             "| channel spread, random |", "| --- | --- | --- | --- | --- | --- |"]
    for kind in [k for k, _ in KINDS] + ["other"]:
        if kind in trained:
            t, r = trained[kind], random[kind]
            lines.append(f"| {kind} | {t['layers']} | {t['outlier']:.2f} | {r['outlier']:.2f} | {t['spread']:.2f} "
                         f"| {r['spread']:.2f} |")
    out = REPO / "benchmarks" / "results" / "activation_ranges_scenes_sdxl.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
