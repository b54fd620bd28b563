"""Compares quantized UNets with the model's own fp16 UNet: image metrics per prompt, the
teacher-forced noise-prediction error per step, an image grid and markdown/JSON reports.

    python evaluate.py +variants.int8=quantized/<checkpoint folder>
"""

import hydra

from sdquant.cli import exits_cleanly
from sdquant.config import register_schemas

register_schemas()


@hydra.main(version_base="1.3", config_path="conf", config_name="sd_xl_evaluate")
@exits_cleanly
def main(cfg) -> None:
    # Imported once exits_cleanly has checked the installed packages: the stages import ModelOpt.
    from sdquant.workflow.evaluate import run_evaluate

    run_evaluate(cfg)


if __name__ == "__main__":
    main()
