"""A trained Wan scene model's held-out prompt adherence at several guidance pairs (the first
expert's scale, and the second's; classifier-free guidance at 1 or less is off), each over the same
held-out prompts and seeds as the training record scores them, with diffusers' own WanPipeline:
which guidance the model should be sampled with, before its quality figures are taken.

    python benchmarks/scenes_wan_guidance.py --model-dir /tmp/rP --pairs 5,2,3.5:1 --out guidance.json

A pair `a:b` runs guidance_scale=a on the first (high-noise) expert and guidance_scale_2=b on the
second; a single value runs both at it. About 100 s a pair for 128 prompts on a 2-core CPU.
--validation scores the held-out captions the held-out file does not hold instead (32 of one
object and 80 of two, beside its 64 and 64): a pair chosen on them has not seen the prompts the
model's figures are taken on.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from diffusers import WanPipeline

from sdquant.families import family_of
from sdquant.quality import training


def guidance_pair(text: str) -> tuple[float, float | None]:
    first, _, second = text.partition(":")
    return float(first), float(second) if second else None


def validation_prompts(kind, scored: list[str]) -> list[str]:
    """The held-out captions of one object, then of two, that `scored` does not hold."""
    return [caption for objects in (1, 2)
            for caption in sorted({clip.caption() for clip in kind.module.split(True, objects)} - set(scored))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--pairs", required=True, help="comma-separated guidance values or first:second pairs")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=64, help="held-out prompts of one object, and as many of two")
    parser.add_argument("--validation", action="store_true", help="the held-out prompts outside the held-out file")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    pairs = [guidance_pair(text) for text in args.pairs.split(",")]
    family = family_of("wan")
    kind = training.SCENE_KINDS[family.output]
    pipe = WanPipeline.from_pretrained(args.model_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    scored = [scene.caption() for scene in training.held_out_scenes(kind, args.prompts)]
    prompts = validation_prompts(kind, scored) if args.validation else scored
    rows = []
    for first, second in pairs:
        started = time.perf_counter()
        kwargs = family.pipeline_call_kwargs(pipe) | ({} if second is None else {"guidance_scale_2": second})
        adherence = training.held_out_adherence(pipe, kind, prompts, args.steps, first, 0, kwargs)
        rows.append({"guidance_scale": first, "guidance_scale_2": second, "seconds": round(time.perf_counter() - started),
                     **{key: round(value, 4) for key, value in adherence.items()}})
        print(json.dumps(rows[-1]), flush=True)
    record = {"model_dir": str(args.model_dir), "steps": args.steps, "prompts": len(prompts),
              "prompt_set": "validation: held-out captions outside the held-out file" if args.validation else
              "the held-out file's",
              "device": "cpu, fp32", "rows": rows}
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
