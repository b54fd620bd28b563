"""The README's pictures of the scene models: chosen columns of a quality report's grid (one cell per
prompt and variant, a 64x64 image or a video's first, middle and last frames, its columns in the
order the report's header names them), the first eight held-out two-object prompts (the report's
rows 64 to 71, as the held-out file lists them), enlarged, with a label over each column. Each
column's checkpoint is the first calibration's.

    python benchmarks/readme_picture.py                        # after benchmarks/quality_over_calibrations.py
    python benchmarks/readme_picture.py --model scenes_flux    # after its runs on scenes_flux
    python benchmarks/readme_picture.py --model scenes_wan     # after its runs on scenes_wan
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

RESULTS = Path(__file__).resolve().parent / "results"
# The first eight held-out prompts of two objects: the held-out file holds 64 of one object first.
ROWS = tuple(range(64, 72))


@dataclass(frozen=True)
class Picture:
    reports: tuple[str, ...]   # the reports (results/<name>.md and <name>_grid.png) its columns come from
    shown: dict[str, str]      # column -> label; the first report's reference is "reference"
    out: str


PICTURES = {
    "scenes_sdxl": Picture(
        ("quality_means_scenes_sdxl_cpu",),
        {"reference": "unquantized", "int8_l3_c0": "INT8 L3", "fp8_l3_c0": "FP8 L3", "fp8_l4_c0": "FP8 L4",
         "fp8_l3_deepcache2_c0": "FP8 L3 + DeepCache/2"},
        "scenes_fp16_int8_fp8.png"),
    "scenes_flux": Picture(
        ("quality_means_scenes_flux_cpu_fp8", "quality_means_scenes_flux_cpu"),
        {"reference": "unquantized", "int8_l3_c0": "INT8 L3", "fp8_l3_c0": "FP8 L3", "fp8_l4_c0": "FP8 L4",
         "fp8_l4_taylorseer_blocks2_c0": "FP8 L4 + TaylorSeer/2"},
        "scenes_flux_fp16_int8_fp8.png"),
    "scenes_wan": Picture(
        ("quality_means_scenes_wan_cpu_fp8", "quality_means_scenes_wan_cpu"),
        {"reference": "unquantized", "int8_l3_c0": "INT8 L3", "fp8_l4_c0": "FP8 L4",
         "fp8_l4_taylorseer_blocks2_warmup1_c0": "FP8 L4 + TaylorSeer/2, 1 full step first"},
        "scenes_wan_fp16_int8_fp8.png"),
}
CELL, SCALE, LABEL_HEIGHT = 64, 2, 20


def grid_columns(report: str) -> list[str]:
    """The grid's columns as the report's header names them, the reference first (as "reference")."""
    header = (RESULTS / f"{report}.md").read_text()
    names = re.search(r"Grid \(`grid.png`\) columns: (.*)\.", header).group(1).split(" | ")
    return ["reference", *names[1:]]


def cell(report: str, column: str, row: int) -> Image.Image:
    """One prompt's cell of one column, enlarged: a 64x64 image, or a video's frames side by side (as
    wide as the grid's width over its columns)."""
    grid = Image.open(RESULTS / f"{report}_grid.png").convert("RGB")
    columns = grid_columns(report)
    width = grid.width // len(columns)
    left = columns.index(column) * width
    return grid.crop((left, row * CELL, left + width, (row + 1) * CELL)).resize((width * SCALE, CELL * SCALE),
                                                                               Image.NEAREST)


def source(shape: Picture, column: str) -> str:
    """The first of the picture's reports whose grid has `column`."""
    return next(report for report in shape.reports if column in grid_columns(report))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(PICTURES), default="scenes_sdxl")
    args = parser.parse_args()
    shape = PICTURES[args.model]
    cells = {column: [cell(source(shape, column), column, row) for row in ROWS] for column in shape.shown}
    width, height = next(iter(cells.values()))[0].size
    picture = Image.new("RGB", (width * len(shape.shown), LABEL_HEIGHT + height * len(ROWS)), "white")
    draw = ImageDraw.Draw(picture)
    font = ImageFont.load_default()
    for x, (column, label) in enumerate(shape.shown.items()):
        draw.text((x * width + 4, 4), label, fill="black", font=font)
        for y, image in enumerate(cells[column]):
            picture.paste(image, (x * width, LABEL_HEIGHT + y * height))
    out = RESULTS / shape.out
    picture.save(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
