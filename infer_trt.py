"""Runs the text-to-image pipeline on the engines (or their ONNX files, or the diffusers modules)
and reports latency per stage.

    python infer_trt.py unet_xl=sdxl_export/plan/unet_xl.plan
"""

import hydra

from sdquant.cli import exits_cleanly
from sdquant.config import register_schemas

register_schemas()


@hydra.main(version_base="1.3", config_path="conf", config_name="sd_xl_trt_inference")
@exits_cleanly
def main(cfg) -> None:
    # Imported once exits_cleanly has checked the installed packages: the stages import ModelOpt.
    from sdquant.workflow.infer_trt import run_infer

    run_infer(cfg)


if __name__ == "__main__":
    main()
