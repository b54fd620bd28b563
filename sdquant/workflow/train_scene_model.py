"""tools/train_scene_model.py: trains the built-in scene model and writes its diffusers folder."""

from __future__ import annotations

import time
from pathlib import Path

from ..config import settled_config, validate_train_scene
from ..load import resolve_device
from ..report import print_summary


def run_train_scene_model(cfg) -> Path:
    """tools/train_scene_model.py: trains the scene model and writes its diffusers folder."""
    from ..quality.training import train_scene_model

    start = time.perf_counter()
    app = settled_config(cfg)
    validate_train_scene(app)
    out, record = train_scene_model(app, resolve_device(app.device))
    adherence = record["held_out_adherence"]
    if adherence["prompts"]:
        attributes = [name for name in record["attributes"] if adherence.get(name) is not None]
        print(f"held-out prompts, all attributes right: one object {adherence['one_object']:.1%}, two objects "
              f"{adherence['two_objects']:.1%} of {adherence['prompts']} "
              f"({', '.join(f'{name} {adherence[name]:.0%}' for name in attributes)})")
    print_summary("scene model training", sorted(p for p in out.rglob("*") if p.is_file()),
                  time.perf_counter() - start)
    return out
