"""The checkpoints of older sdquant that this one no longer reads, each refused in one line that says
how to make it again.

Every other checkpoint folder loads (infer_trt.py, export_trt.py, evaluate.py) whatever its
fingerprint, since its backbone files hold the quantizers they were calibrated with; only
quantize.py's reuse asks for the fingerprint of today's settings and recipe.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError

# The record of a folder from before the files were named by backbone (one backbone, in unet.mto).
OLDER_RECORD_FILE = "unet.json"


def refuse_older_layout(folder: Path, key: str, path: Path) -> None:
    """Refuses a folder of the layout before the files were named by backbone."""
    if (folder / OLDER_RECORD_FILE).is_file():
        raise UserError(f"{key}={path} is a checkpoint of the layout before its files were named by backbone (its "
                        f"record {OLDER_RECORD_FILE}), which sdquant no longer reads: quantize again with force=true")


def refuse_older_recipe(record: dict, key: str, path: Path) -> None:
    """Refuses a checkpoint calibrated before NeMo's recipe (its record has no percentile_layers)."""
    if "percentile_layers" not in record.get("settings", {}).get("quantize", {}):
        raise UserError(f"{key}={path} was calibrated by an sdquant older than NeMo's recipe (Percentile Quant "
                        "then covered every activation quantizer, and its means divided by the runs): quantize "
                        "again (quantize.percentile_layers=all quantize.mean_divisor=runs reproduces the old recipe)")
