"""Writes a family's full-size architecture with random weights as a diffusers folder, so that the
scripts that read a model's folder (quantize.py, serve.py, infer_trt.py) run at full size where no
weights can be downloaded: model.source=<the folder>. Speed only; its images are noise.

    python benchmarks/full_size_folder.py --family sdxl --out /tmp/sdxl_full
    python quantize.py model=sdxl_base model.source=/tmp/sdxl_full quantize.format=fp8 quantize.quant_level=3
    python serve.py model=sdxl_base model.source=/tmp/sdxl_full backend=torch ...

--size tiny writes the family's tiny architecture instead (a dry run on a CPU).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from sdquant.artifacts import atomic_folder
from sdquant.families import family_of
from sdquant.families.base import full_size_on_gpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", required=True, help="sdxl, flux, sd3, wan, ... (model.family's names)")
    parser.add_argument("--out", type=Path, required=True, help="the folder to write (must not exist)")
    parser.add_argument("--size", default="full", help="the family's architecture size: full (default) or tiny")
    args = parser.parse_args()
    family = family_of(args.family)
    if args.size not in family.sizes:
        parser.error(f"--size {args.size}: {args.family} has {', '.join(family.sizes)}")
    if args.out.exists():
        parser.error(f"--out {args.out} exists: give a new folder")
    start = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pipe = full_size_on_gpu(family, args.size, device)
    with atomic_folder(args.out) as staging:
        pipe.save_pretrained(staging)
    print(f"wrote {args.out}: {args.family} {args.size}, random weights in {family.gpu_dtype}, "
          f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
