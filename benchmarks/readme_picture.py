"""The README's picture of the scene model: chosen columns and rows of quality_recipes.py's grid
(one 64x64 cell per prompt and variant, columns in its report's order), enlarged, with a label
over each column.

    python benchmarks/readme_picture.py                        # after benchmarks/quality_recipes.py
    python benchmarks/readme_picture.py --model scenes_flux    # after its run on scenes_flux
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Picture:
    grid_columns: tuple[str, ...]   # the grid's columns: fp16 first, then quality_recipes.py's recipes in order
    shown: dict[str, str]           # column -> label
    rows: tuple[int, ...]           # the report's rows (prompts) to show


PICTURES = {
    # Held-out two-object prompts (the report's rows 64 on): four that fp16, the default INT8 and
    # FP8 level 4 draw right and so does the older INT8 recipe, then four that the older recipe gets
    # wrong (colour, shape and colour, colour, shape: the report's adherence table).
    "scenes_sdxl": Picture(
        ("fp16", "int8_l1", "int8_l2", "int8_l25", "int8_l3", "int8_l3_true_mean", "int8_l3_c128",
         "int8_l3_c128_true_mean", "int8_l3_older", "int8_l3_max", "int8_l3_a05", "int8_l3_a10", "int8_l3_p05",
         "fp8_l3", "fp8_l4", "fp8_l4_percentile"),
        {"fp16": "fp16", "int8_l3": "INT8 L3 (NeMo)", "int8_l3_older": "INT8 L3 (older)", "fp8_l4": "FP8 L4"},
        (65, 72, 77, 79, 64, 69, 70, 74)),
    # The first eight held-out two-object prompts, as they come.
    "scenes_flux": Picture(
        ("fp16", "int8_l3_a05", "int8_l3", "int8_l3_a10", "fp8_l3", "fp8_l4"),
        {"fp16": "fp16", "int8_l3": "INT8 L3", "fp8_l3": "FP8 L3", "fp8_l4": "FP8 L4"},
        tuple(range(64, 72))),
}
CELL, SCALE, LABEL_HEIGHT = 64, 2, 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(PICTURES), default="scenes_sdxl")
    args = parser.parse_args()
    shape = PICTURES[args.model]
    grid = Image.open(RESULTS / f"quality_recipes_{args.model}_grid.png").convert("RGB")
    out = RESULTS / ("scenes_fp16_int8_fp8.png" if args.model == "scenes_sdxl" else f"{args.model}_fp16_int8_fp8.png")
    side = CELL * SCALE
    picture = Image.new("RGB", (side * len(shape.shown), LABEL_HEIGHT + side * len(shape.rows)), "white")
    draw = ImageDraw.Draw(picture)
    font = ImageFont.load_default()
    for x, (column, label) in enumerate(shape.shown.items()):
        left = shape.grid_columns.index(column) * CELL
        draw.text((x * side + 4, 4), label, fill="black", font=font)
        for y, row in enumerate(shape.rows):
            cell = grid.crop((left, row * CELL, left + CELL, (row + 1) * CELL)).resize((side, side), Image.NEAREST)
            picture.paste(cell, (x * side, LABEL_HEIGHT + y * side))
    picture.save(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
