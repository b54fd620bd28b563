"""Trains a built-in scene model from scratch on captioned scenes of one and two objects: the
SDXL-architecture one (the default config), the Flux-architecture one (train_scene_flux), or the
Wan2.2-architecture one on clips of moving shapes (train_scene_wan).

    python tools/train_scene_model.py out_dir=scenes_sdxl                        # one H100
    python tools/train_scene_model.py --config-name train_scene_flux out_dir=scenes_flux
    python tools/train_scene_model.py --config-name train_scene_wan out_dir=scenes_wan
    python tools/train_scene_model.py device=cpu vae.steps=2 denoiser.steps=2 ...   # a CPU smoke run
"""

import hydra

from sdquant.cli import exits_cleanly
from sdquant.config import register_schemas
from sdquant.families import scene_schemas

register_schemas(scene_schemas())


@hydra.main(version_base="1.3", config_path="../conf", config_name="train_scene_model")
@exits_cleanly
def main(cfg) -> None:
    # Imported once exits_cleanly has checked the installed packages.
    from sdquant.workflow.train_scene_model import run_train_scene_model

    run_train_scene_model(cfg)


if __name__ == "__main__":
    main()
