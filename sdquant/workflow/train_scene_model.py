"""tools/train_scene_model.py: trains the built-in scene model and writes its diffusers folder."""

from __future__ import annotations

import time
from pathlib import Path

from omegaconf import OmegaConf

from ..config import validate_train_scene
from ..load import resolve_device
from ..report import print_summary


def run_train_scene_model(cfg) -> Path:
    """tools/train_scene_model.py: trains the scene model and writes its diffusers folder."""
    from ..quality.training import train_scene_model

    start = time.perf_counter()
    validate_train_scene(cfg)
    # The settled config: the schema's own typed objects, which nothing changes.
    out, record = train_scene_model(OmegaConf.to_object(cfg), resolve_device(cfg.device))
    adherence = record["held_out_adherence"]
    if adherence["prompts"]:
        attributes = [name for name in record["attributes"] if adherence.get(name) is not None]
        print(f"held-out prompts, all attributes right: one object {adherence['one_object']:.1%}, two objects "
              f"{adherence['two_objects']:.1%} of {adherence['prompts']} "
              f"({', '.join(f'{name} {adherence[name]:.0%}' for name in attributes)})")
    print_summary("scene model training", sorted(p for p in out.rglob("*") if p.is_file()),
                  time.perf_counter() - start)
    return out
