"""Trains the built-in scene model, an SDXL-architecture pipeline, from scratch on captioned scenes.

    python tools/train_scene_model.py out_dir=scenes_sdxl                  # one H100, about 15 minutes
    python tools/train_scene_model.py device=cpu vae.steps=2 unet.steps=2 ...   # a CPU smoke run
"""

import hydra

from sdquant.cli import exits_cleanly
from sdquant.config import register_schemas

register_schemas()


@hydra.main(version_base="1.3", config_path="../conf", config_name="train_scene_model")
@exits_cleanly
def main(cfg) -> None:
    # Imported once exits_cleanly has checked the installed packages.
    from sdquant.workflow.train_scene_model import run_train_scene_model

    run_train_scene_model(cfg)


if __name__ == "__main__":
    main()
