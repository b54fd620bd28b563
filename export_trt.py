"""Exports the pipeline's networks (with the quantized UNet when given) to ONNX.

    python export_trt.py model=tiny_sdxl quantized_unet=quantized/<checkpoint folder>
"""

import hydra

from sdquant.config import register_schemas
from sdquant.errors import exits_cleanly
from sdquant.workflow import run_export

register_schemas()


@hydra.main(version_base="1.3", config_path="conf", config_name="sd_xl_export")
@exits_cleanly
def main(cfg) -> None:
    run_export(cfg)


if __name__ == "__main__":
    main()
