"""The README's picture of the scene model: chosen columns and rows of quality_recipes.py's grid
(one 64x64 cell per prompt and variant, columns in its report's order), enlarged, with a label
over each column.

    python benchmarks/readme_picture.py     # after benchmarks/quality_recipes.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

RESULTS = Path(__file__).resolve().parent / "results"
# quality_recipes.py's columns: fp16 first, then its recipes in order.
GRID_COLUMNS = ("fp16", "int8_l1", "int8_l2", "int8_l25", "int8_l3", "int8_l3_true_mean", "int8_l3_c128",
                "int8_l3_c128_true_mean", "int8_l3_older", "int8_l3_max", "int8_l3_a05", "int8_l3_a10",
                "int8_l3_p05", "fp8_l3", "fp8_l4", "fp8_l4_percentile")
SHOWN = {"fp16": "fp16", "int8_l3": "INT8 L3 (NeMo)", "int8_l3_older": "INT8 L3 (older)", "fp8_l4": "FP8 L4"}
# Held-out two-object prompts (the report's rows 64 on): four that fp16, the default INT8 and FP8
# level 4 draw right and so does the older INT8 recipe, then four that the older recipe gets wrong
# (colour, shape and colour, colour, shape: the report's adherence table).
ROWS = (65, 72, 77, 79, 64, 69, 70, 74)
CELL, SCALE, LABEL_HEIGHT = 64, 2, 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", type=Path, default=RESULTS / "quality_recipes_scenes_sdxl_grid.png")
    parser.add_argument("--out", type=Path, default=RESULTS / "scenes_fp16_int8_fp8.png")
    args = parser.parse_args()
    grid = Image.open(args.grid).convert("RGB")
    side = CELL * SCALE
    picture = Image.new("RGB", (side * len(SHOWN), LABEL_HEIGHT + side * len(ROWS)), "white")
    draw = ImageDraw.Draw(picture)
    font = ImageFont.load_default()
    for x, (column, label) in enumerate(SHOWN.items()):
        left = GRID_COLUMNS.index(column) * CELL
        draw.text((x * side + 4, 4), label, fill="black", font=font)
        for y, row in enumerate(ROWS):
            cell = grid.crop((left, row * CELL, left + CELL, (row + 1) * CELL)).resize((side, side), Image.NEAREST)
            picture.paste(cell, (x * side, LABEL_HEIGHT + y * side))
    picture.save(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
