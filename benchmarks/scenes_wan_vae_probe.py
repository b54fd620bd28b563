"""The Wan scene recipe's VAE phase alone at one learning rate, then the detector's reading of its
reconstructions of 64 + 64 held-out clips: a quick look at one VAE setting before a whole recipe
spends its 25 minutes on it. Run one per GPU to compare settings in the same run.

    CUDA_VISIBLE_DEVICES=0 python benchmarks/scenes_wan_vae_probe.py --learning-rate 1e-3 --out a.json &
    CUDA_VISIBLE_DEVICES=1 python benchmarks/scenes_wan_vae_probe.py --learning-rate 4e-4 --out b.json

(benchmarks/results/scenes_wan_training_h200_x2.json: 1e-3 spiked and read back 2% after 2200
steps, 4e-4 read back 71%.)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from quality_recipes import compose_app

from sdquant.config import register_schemas
from sdquant.families import family_of, scene_schemas
from sdquant.quality import scenes
from sdquant.quality import training


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--learning-rate", type=float, required=True)
    parser.add_argument("--steps", type=int, default=2200)
    parser.add_argument("--clips", type=int, default=16384)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    register_schemas(scene_schemas())
    cfg = compose_app("train_scene_wan", [f"vae.steps={args.steps}", f"vae.learning_rate={args.learning_rate}"])
    device = torch.device("cuda")
    family = family_of(cfg.family)
    kind = training.SCENE_KINDS[family.output]
    torch.manual_seed(cfg.seed)
    generator = torch.Generator(device).manual_seed(cfg.seed)
    settled = OmegaConf.to_object(cfg)
    tokenizers = {name: training.SCENE_TOKENIZERS[name](kind.module.caption_vocabulary()) for name in settled.tokenizers}
    pipe = family.build_pipeline(settled.architecture.sizes(scenes.IMAGE_SIZE), tokenizers).to(device)
    data = training.make_dataset(kind, args.clips, cfg.seed, cfg.two_object_share, tokenizers, device)
    log = training.LossLog()
    started = time.perf_counter()
    with torch.backends.cudnn.flags(enabled=True, benchmark=True):
        training.train_vae(pipe.vae, data, cfg.vae, generator, log)
    seconds = time.perf_counter() - started
    record = {"device": torch.cuda.get_device_name(device), "vae": dict(cfg.vae), "clips": args.clips,
              "seconds": round(seconds, 1),
              "loss_every_250_steps": [round(loss, 4) for _, step, loss in log.rows if step % 250 == 0],
              "reconstruction_adherence": training.reconstruction_adherence(
                  pipe.vae, kind, training.held_out_scenes(kind, 64))}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
