"""Serves a model's pipeline over HTTP behind Ray Serve, batching requests as they come.

    python serve.py model=scenes_sdxl backend=torch device=cpu sampling.steps=20
"""

import hydra

from sdquant.cli import exits_cleanly
from sdquant.config import register_schemas

register_schemas()


@hydra.main(version_base="1.3", config_path="conf", config_name="sd_xl_serve")
@exits_cleanly
def main(cfg) -> None:
    # Imported once exits_cleanly has checked the installed packages: the stages import ModelOpt.
    from sdquant.workflow.serve import run_serve

    run_serve(cfg)


if __name__ == "__main__":
    main()
