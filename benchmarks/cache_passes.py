"""How many of a backbone's calls a step cache ran as full passes, per backbone, over prompts: the
speed side of a cache setting whose skips depend on the model (First Block Cache decides per call),
which a random-weight speed run cannot show.

    python benchmarks/cache_passes.py --model scenes_wan --cache first_block:0.2 \\
        --quantized <fp8 checkpoint folder> --prompts-file <prompts, one a line>

Under a threshold it also reads off a fixed schedule (`schedule`, and as wan_full_size.py's
--cache `schedule_setting`): for each backbone, as many steps as its calls ran in full on average
(to the nearest), those that ran in full most often (an earlier step first among equals), which
sampling.cache.backbone_full_steps runs.

--window-frames (with --window-heads-file and --window-min-share) runs the backbones' self-attention
within that many latent frames (torch_backend.attention_window), which changes what a first block
computes and so what First Block Cache decides.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

from harness.caches import SAYS as CACHE_SAYS, SETTING as CACHE_SETTING, cache_block, schedule_setting

from sdquant.api import load
from sdquant.artifacts import write_json
from sdquant.cli import exits_cleanly
from sdquant.errors import UserError
from sdquant.progress import Progress
from sdquant.report import summed_passes


def main(args) -> dict:
    prompts = [line for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
    if not prompts:
        raise UserError(f"--prompts-file {args.prompts_file}: no prompts in it")
    settings = {"quantized_backbone": args.quantized, "torch_backend": {"quantized": args.kernels}} if args.quantized else {}
    if args.window_frames:
        window = {"frames": args.window_frames, "heads_file": args.window_heads_file,
                  "min_share": args.window_min_share}
        settings.setdefault("torch_backend", {})["attention_window"] = {key: value for key, value in window.items()
                                                                         if value is not None}
    cache = cache_block(args.cache)
    with load(args.model, backend="torch", device="cpu", **settings) as pipe:
        counts = summed_passes([pipe([prompt], seed=args.seed, steps=args.steps, cache=cache).cache_passes
                                for prompt in Progress(prompts, "cache passes", "prompts")])
    shares = {name: round(count["full_passes"] / count["calls"], 3) for name, count in counts.items()}
    schedule = {name: most_often_full(count) for name, count in counts.items()}
    return {"model": args.model, "cache": args.cache, "quantized": args.quantized, "prompts": len(prompts),
            "window": settings.get("torch_backend", {}).get("attention_window"),
            "steps": args.steps, "counts": counts, "full_pass_share": shares, "schedule": schedule,
            "schedule_setting": schedule_setting(schedule)}


def most_often_full(count: dict) -> list[int]:
    """A backbone's fixed schedule from its counts: as many steps as each cache context ran in full
    on average, to the nearest, a half up (every context runs its first step in full, so step 0's
    count is the contexts'), the steps run in full most often."""
    by_step = count["full_steps"]
    chosen = math.floor(count["full_passes"] / by_step[0] + 0.5)
    return sorted(sorted(range(len(by_step)), key=lambda step: (-by_step[step], step))[:chosen])


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="scenes_wan")
    parser.add_argument("--cache", required=True, help=CACHE_SAYS)
    parser.add_argument("--quantized", help="a checkpoint folder of quantize.py (default: the 16-bit backbones)")
    parser.add_argument("--kernels", default="fp8", choices=("fake", "fp8", "int8"))
    parser.add_argument("--prompts-file", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--window-frames", type=int, help="self-attention within this many latent frames")
    parser.add_argument("--window-heads-file", help="with --window-frames: the heads' shares inside the window "
                                                    "(default: every head windowed)")
    parser.add_argument("--window-min-share", type=float, help="with --window-heads-file: the least share a "
                                                               "windowed head has inside")
    parser.add_argument("--out", help="a JSON file for the counts (default: printed)")
    args = parser.parse_args(argv)
    if not re.fullmatch(CACHE_SETTING, args.cache):
        parser.error(f"--cache {args.cache}: give {CACHE_SAYS}")
    if (args.window_heads_file or args.window_min_share is not None) and not args.window_frames:
        parser.error("--window-heads-file and --window-min-share go with --window-frames")
    if not Path(args.prompts_file).is_file():
        parser.error(f"--prompts-file {args.prompts_file}: no such file")
    return args


if __name__ == "__main__":
    options = parse()
    result = exits_cleanly(main)(options)
    if options.out:
        write_json(Path(options.out), result)
        print(f"wrote {options.out}: full-pass shares {result['full_pass_share']}, as a fixed schedule "
              f"{result['schedule_setting']}")
    else:
        print(json.dumps(result, indent=1))
