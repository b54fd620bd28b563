"""Calibrates the UNet over the denoising steps and quantizes it to INT8 or FP8 with ModelOpt.

    python quantize.py model=tiny_sdxl quantize.quant_level=3
"""

import hydra

from sdquant.cli import exits_cleanly
from sdquant.config import register_schemas

register_schemas()


@hydra.main(version_base="1.3", config_path="conf", config_name="sd_xl_quantize")
@exits_cleanly
def main(cfg) -> None:
    # Imported once exits_cleanly has checked the installed packages: the stages import ModelOpt.
    from sdquant.workflow.quantize import run_quantize

    run_quantize(cfg)


if __name__ == "__main__":
    main()
