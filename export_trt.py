"""Exports the pipeline's networks (with the quantized UNet when given) to ONNX.

    python export_trt.py model=tiny_sdxl quantized_unet=quantized/<checkpoint folder>
"""

import hydra

from sdquant.cli import exits_cleanly
from sdquant.config import register_schemas

register_schemas()


@hydra.main(version_base="1.3", config_path="conf", config_name="sd_xl_export")
@exits_cleanly
def main(cfg) -> None:
    # Imported once exits_cleanly has checked the installed packages: the stages import ModelOpt.
    from sdquant.workflow.export_trt import run_export

    run_export(cfg)


if __name__ == "__main__":
    main()
