"""tools/train_scene_model.py: a CPU smoke run writes a folder that loads like any SDXL folder."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from safetensors.torch import load_file

from sdquant.quality import scenes
from sdquant.config import ModelConfig, settled_config
from sdquant.errors import EXIT_USER_ERROR
from sdquant.families.flux import FLUX
from sdquant.load import load_pipeline

from conftest import REPO

SMOKE = ["device=cpu", "dataset_size=32", "vae.steps=2", "vae.batch_size=4", "denoiser.steps=3", "denoiser.batch_size=4",
         "eval_prompts=2", "eval_steps=2", "architecture.vae_channels=[32,32,32]", "architecture.vae_layers=1",
         "architecture.text_layers=2"]
SDXL_SMOKE = [*SMOKE, "architecture.unet_channels=[32,32,32]"]
FLUX_SMOKE = ["--config-name", "train_scene_flux", *SMOKE, "architecture.double_blocks=1",
              "architecture.single_blocks=1"]


def _train(tmp_path, *overrides, smoke=SDXL_SMOKE):
    return subprocess.run([sys.executable, str(REPO / "tools" / "train_scene_model.py"), *smoke, *overrides,
                           f"hydra.run.dir={tmp_path / 'hydra'}"], capture_output=True, text=True, timeout=600)


def test_smoke_run_writes_a_loadable_fp16_sdxl_folder_with_its_training_record(tmp_path):
    out = tmp_path / "scenes"
    result = _train(tmp_path, f"out_dir={out}")
    assert result.returncode == 0, result.stderr
    record = json.loads((out / "training.json").read_text())
    assert record["config"]["denoiser"]["steps"] == 3 and record["config"]["seed"] == 0
    assert set(record["final_loss"]) == {"vae", "unet"} and all(v > 0 for v in record["final_loss"].values())
    assert record["held_out_adherence"]["prompts"] == 4 and "torch" in record["versions"]
    assert (out / "loss_log.csv").read_text().startswith("phase,step,loss\n")
    held_out = (out / "heldout_prompts.txt").read_text().splitlines()
    assert [scenes.parse_caption(prompt).objects for prompt in held_out] == [1] * 64 + [2] * 64

    pipe = load_pipeline(ModelConfig(name="scenes", family="sdxl", source=str(out)), torch.device("cpu"),
                         torch.float32)
    assert pipe.text_encoder_2.config.projection_dim == 128 and pipe.unet.config.addition_embed_type == "text_time"
    stored = {t.dtype for part in ("unet", "vae", "text_encoder", "text_encoder_2")
              for t in load_file(next((out / part).glob("*.safetensors"))).values()}
    assert stored == {torch.float16}
    # Every caption word is one token of the shipped tokenizer.
    ids = pipe.tokenizer("a small red circle on the left, white background").input_ids
    assert len(ids) == 2 + 10


def test_an_existing_folder_is_kept_unless_forced_and_bad_widths_are_refused(tmp_path):
    out = tmp_path / "scenes"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    refused = _train(tmp_path, f"out_dir={out}")
    assert refused.returncode == EXIT_USER_ERROR and "force=true" in refused.stderr
    assert (out / "keep.txt").read_text() == "mine"
    bad = _train(tmp_path, f"out_dir={tmp_path / 'other'}", "architecture.unet_channels=[48,64]")
    assert bad.returncode == EXIT_USER_ERROR and "architecture.unet_channels" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "other").exists()


def test_flux_smoke_run_writes_a_folder_that_loads_as_flux(tmp_path):
    out = tmp_path / "scenes_flux"
    result = _train(tmp_path, f"out_dir={out}", smoke=FLUX_SMOKE)
    assert result.returncode == 0, result.stderr
    record = json.loads((out / "training.json").read_text())
    assert record["family"] == "flux" and set(record["final_loss"]) == {"vae", "transformer"}
    assert record["held_out_adherence"]["prompts"] == 4
    pipe = load_pipeline(ModelConfig(name="scenes_flux", family="flux", source=str(out)), torch.device("cpu"),
                         torch.float32)
    assert pipe.transformer.config.num_layers == 1 and not pipe.transformer.config.guidance_embeds
    assert pipe.vae.config.latent_channels == 16 and pipe.vae.config.shift_factor is not None
    # Every caption word is one piece of the T5 tokenizer too (and the end token), and the model's T5
    # sequence is its tokenizer's 32, which the diffusers pipeline that calibration runs is told.
    assert len(pipe.tokenizer_2("a red circle on the left and a blue square on the right, white background")
               .input_ids) == 16 + 1
    assert FLUX.pipeline_call_kwargs(pipe) == {"max_sequence_length": 32}
    seen = []
    pipe.transformer.register_forward_hook(lambda _m, _a, kwargs, _o: seen.append(kwargs["encoder_hidden_states"].shape),
                                           with_kwargs=True)
    pipe("a red circle on the left, white background", num_inference_steps=1, height=64, width=64,
         output_type="latent", **FLUX.pipeline_call_kwargs(pipe))
    assert [shape[1] for shape in seen] == [32]


WAN_SMOKE = ["--config-name", "train_scene_wan", "device=cpu", "dataset_size=16", "vae.steps=2", "vae.batch_size=2",
             "denoiser.steps=2", "denoiser.shared_steps=2", "denoiser.batch_size=2", "eval_prompts=1", "eval_steps=2",
             "architecture.layers=1", "architecture.vae_base=8", "architecture.ffn=64", "denoiser.compile=false",
             "vae.cuda_graph=false"]


@pytest.fixture(scope="module")
def wan_smoke(tmp_path_factory):
    """One smoke run of the Wan scene model's training, which two tests read."""
    tmp_path = tmp_path_factory.mktemp("wan_smoke")
    out = tmp_path / "scenes_wan"
    result = _train(tmp_path, f"out_dir={out}", smoke=WAN_SMOKE)
    assert result.returncode == 0, result.stderr
    return out


def test_wan_smoke_run_writes_a_two_expert_video_folder_that_loads_as_wan(wan_smoke):
    from sdquant.quality import clips

    out = wan_smoke
    record = json.loads((out / "training.json").read_text())
    assert record["family"] == "wan"
    assert set(record["final_loss"]) == {"vae", "transformer at every noise level", "transformer+transformer_2"}
    assert set(record["parameters"]) == {"text_encoder", "transformer", "transformer_2", "vae"}
    assert record["held_out_adherence"]["prompts"] == 2 and "direction" in record["held_out_adherence"]
    assert "direction" in record["reconstruction_adherence"]
    assert {tuple(pair) for pair in record["held_out_pairs"]} == clips.held_out_pairs()
    held_out = (out / "heldout_prompts.txt").read_text().splitlines()
    assert [clips.parse_caption(prompt).objects for prompt in held_out] == [1] * 64 + [2] * 64
    assert all(not clips.is_held_out(clips.parse_caption(prompt))
               for prompt in (out / "calib_prompts.txt").read_text().splitlines())

    pipe = load_pipeline(ModelConfig(name="scenes_wan", family="wan", source=str(out)), torch.device("cpu"),
                         torch.float32)
    assert pipe.config.boundary_ratio == 0.875 and pipe.transformer_2.config.num_layers == 1
    # A VAE of 4x in space and 2x in time (9 frames of 64x64 -> 5 latent frames of 16x16), its
    # latents' statistics measured on the training clips, not the unit ones it was built with.
    assert pipe.vae_scale_factor_spatial == 4 and pipe.vae_scale_factor_temporal == 2
    assert pipe.vae.config.latents_std != [1.0] * 16
    stored = {t.dtype for part in ("transformer", "transformer_2", "vae", "text_encoder")
              for t in load_file(next((out / part).glob("*.safetensors"))).values()}
    assert stored == {torch.float16}
    # Every caption word is one piece of the UMT5 tokenizer (and the end token).
    caption = "a red circle at the top moving from left to right and a blue square at the bottom moving from " \
              "right to left, white background"
    assert len(pipe.tokenizer(caption).input_ids) == len(caption.replace(",", " ,").split()) + 1


def test_a_second_run_keeps_the_first_runs_vae_and_refuses_a_folder_without_one(wan_smoke, tmp_path):
    out = tmp_path / "again"
    result = _train(tmp_path, f"out_dir={out}", f"vae_from={wan_smoke}", "denoiser.learning_rate=1e-3", smoke=WAN_SMOKE)
    assert result.returncode == 0, result.stderr
    first, second = (json.loads((folder / "training.json").read_text()) for folder in (wan_smoke, out))
    # The VAE's weights and latent statistics are the first run's, and so is its training time.
    assert load_file(out / "vae/diffusion_pytorch_model.safetensors").keys() == \
        load_file(wan_smoke / "vae/diffusion_pytorch_model.safetensors").keys()
    assert all(torch.equal(a, b) for a, b in zip(
        load_file(out / "vae/diffusion_pytorch_model.safetensors").values(),
        load_file(wan_smoke / "vae/diffusion_pytorch_model.safetensors").values()))
    assert second["seconds"]["vae"] == first["seconds"]["vae"] and second["vae_from"] == str(wan_smoke)
    assert (out / "loss_log.csv").read_text().count("\nvae,") == (wan_smoke / "loss_log.csv").read_text().count("\nvae,")

    refused = _train(tmp_path, f"out_dir={tmp_path / 'none'}", f"vae_from={tmp_path}", smoke=WAN_SMOKE)
    assert refused.returncode == EXIT_USER_ERROR and f"vae_from={tmp_path}" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "none").exists()


def test_shared_steps_train_the_first_expert_alone_then_start_the_second_from_it(wan_smoke, tmp_path):
    """denoiser.shared_steps: a phase of the first expert at every noise level, logged and timed on
    its own, whose weights both experts then start from. At a learning rate of 1e-12 the second
    phase leaves them where they started, so the experts end equal; built apart, they differ."""
    out = tmp_path / "shared"
    result = _train(tmp_path, f"out_dir={out}", f"vae_from={wan_smoke}", "denoiser.shared_steps=3",
                    "denoiser.learning_rate=1e-12", smoke=WAN_SMOKE)
    assert result.returncode == 0, result.stderr
    record = json.loads((out / "training.json").read_text())
    alone = "transformer at every noise level"
    assert set(record["final_loss"]) == {"vae", alone, "transformer+transformer_2"} and alone in record["seconds"]
    assert f"\n{alone},3," in (out / "loss_log.csv").read_text()
    first, second = (load_file(out / part / "diffusion_pytorch_model.safetensors")
                     for part in ("transformer", "transformer_2"))
    assert all(torch.equal(first[key], second[key]) for key in first)
    built_apart = load_file(wan_smoke / "transformer_2/diffusion_pytorch_model.safetensors")
    assert not all(torch.equal(first[key], built_apart[key]) for key in first)


def test_quantize_refuses_a_level_that_leaves_an_expert_nothing_to_quantize(wan_smoke, tmp_path):
    """The smoke model's one block per expert is one the Wan recipe keeps in high precision."""
    result = subprocess.run([sys.executable, str(REPO / "quantize.py"), "model=scenes_wan",
                             f"model.source={wan_smoke}", f"out_dir={tmp_path / 'quantized'}",
                             f"hydra.run.dir={tmp_path / 'hydra'}"], capture_output=True, text=True, timeout=600)
    assert result.returncode == EXIT_USER_ERROR and "Traceback" not in result.stderr
    assert "every layer of this model's transformer and transformer_2 is one its family keeps" in result.stderr
    assert not (tmp_path / "quantized").exists() or not any((tmp_path / "quantized").iterdir())


def test_each_wan_expert_is_trained_and_sampled_on_its_own_side_of_the_boundary():
    """Training draws each expert's noise levels where WanPipeline's sampler hands it its steps:
    the high-noise expert from the boundary (t >= 875) up, near the pure noise a video starts from
    too; the low-noise expert below, near the boundary too."""
    from sdquant.config import DenoiserTraining
    from sdquant.families.wan import WAN
    from sdquant.families.wan.scene import WanSceneArchitecture
    from sdquant.quality import clips
    from sdquant.quality.training import SCENE_KINDS, make_dataset, scene_t5_tokenizer

    cpu = torch.device("cpu")
    tokenizer = scene_t5_tokenizer(clips.caption_vocabulary())
    arch = WanSceneArchitecture(heads=2, layers=1, ffn=64, text_layers=1, vae_base=8)
    pipe = WAN.build_pipeline(arch.sizes(64), {"t5": tokenizer})
    data = make_dataset(SCENE_KINDS["video"], 8, 0, 0.5, {"t5": tokenizer}, cpu)
    seen = {name: [] for name in ("transformer", "transformer_2")}
    for name in seen:
        getattr(pipe, name).register_forward_pre_hook(
            lambda _module, _args, kwargs, name=name: seen[name].append(kwargs["timestep"].flatten().float()),
            with_kwargs=True)
    loss_of = WAN.scene_loss(pipe, torch.randn(8, 16, 3, 16, 16), data, DenoiserTraining(batch_size=256),
                             torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss_of(torch.randint(8, (256,), generator=torch.Generator().manual_seed(0)))
    high, low = (torch.cat(seen[name]) for name in ("transformer", "transformer_2"))
    assert high.min() >= 875 and low.max() < 875
    # The sampler's first two steps (t = 1000, 983) and the two after the boundary (848, 818): 16% and
    # 14% of each expert's draws fall beyond them, where levels squeezed into each share gave 3% and 0.4%.
    assert (high > 983).float().mean() > 0.08 and (low > 818).float().mean() > 0.07

    seen = {name: [] for name in seen}
    pipe("a red circle moving slowly from left to right, white background", num_inference_steps=20, num_frames=9,
         height=64, width=64, output_type="latent", max_sequence_length=32)
    assert torch.cat(seen["transformer"]).min() >= 875 and torch.cat(seen["transformer_2"]).max() < 875
    assert len(seen["transformer"]) + len(seen["transformer_2"]) == 2 * 20


def test_the_one_cycle_schedule_runs_through_any_number_of_steps_and_keeps_the_recipes_warm_up():
    from sdquant.quality.training import one_cycle
    for steps in range(1, 61):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        schedule = one_cycle(optimizer, 1e-3, steps)
        for _ in range(steps):
            optimizer.step()
            schedule.step()
        assert all(math.isfinite(group["lr"]) for group in optimizer.param_groups), steps
    # The shipped models' step counts keep OneCycleLR's 5% warm-up they were trained with.
    assert one_cycle(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3), 1e-3, 3000).total_steps == 3000
    assert one_cycle(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3), 1e-3, 3000)._schedule_phases[0][
        "end_step"] == 0.05 * 3000 - 1


@pytest.mark.parametrize("frame_levels, refused", [(-1, True), (0, False), (2, False), (3, True)])
def test_the_wan_vaes_frame_levels_are_refused_past_its_levels(frame_levels, refused):
    from conftest import compose_config
    from sdquant.errors import UserError
    from sdquant.families import scene_family
    from sdquant.families.wan import WAN
    cfg = settled_config(compose_config("train_scene_wan", [f"architecture.vae_frame_levels={frame_levels}"]))
    if refused:
        with pytest.raises(UserError, match="architecture.vae_frame_levels"):
            scene_family(cfg)
    else:
        assert scene_family(cfg) is WAN
        vae = dict(cfg.architecture.sizes(64).vae)
        assert vae["temperal_downsample"] == [False] * (2 - frame_levels) + [True] * frame_levels
        # WanPipeline reads the frame scale from the config: a wrong one drew 5 of 9 frames.
        assert vae["scale_factor_temporal"] == 2 ** frame_levels


def test_shared_steps_below_zero_are_refused_and_an_image_config_has_none():
    from conftest import compose_config
    from hydra.errors import ConfigCompositionException
    from sdquant.errors import UserError
    from sdquant.families import scene_family
    with pytest.raises(UserError, match="denoiser.shared_steps=-1"):
        scene_family(settled_config(compose_config("train_scene_wan", ["denoiser.shared_steps=-1"])))
    # One backbone has no expert to share: the key is the Wan schema's alone.
    with pytest.raises(ConfigCompositionException, match="shared_steps"):
        compose_config("train_scene_flux", ["denoiser.shared_steps=1"])


def test_a_config_trains_its_own_familys_architecture_and_names_the_config_of_another():
    from conftest import compose_config
    from sdquant.errors import UserError
    from sdquant.families import scene_family
    with pytest.raises(UserError, match="family=flux: this config trains a sdxl scene model, whose architecture it "
                                        "holds: use --config-name train_scene_flux"):
        scene_family(settled_config(compose_config("train_scene_model", ["family=flux"])))
    with pytest.raises(UserError, match=r"a family with a scene model \(sdxl, flux, wan\)"):
        scene_family(settled_config(compose_config("train_scene_flux", ["family=sd3"])))


def test_a_vae_step_in_cuda_graphs_is_refused_on_the_cpu_before_anything_is_written(tmp_path):
    out = tmp_path / "graphed"
    result = _train(tmp_path, f"out_dir={out}", "vae.cuda_graph=true", smoke=WAN_SMOKE)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "vae.cuda_graph=true" in result.stderr and "device=cuda" in result.stderr
    assert not out.exists()


def test_a_compiled_training_step_learns_as_the_eager_one(wan_smoke, tmp_path):
    """denoiser.compile=true (torch.compile of the step, for launch-bound GPUs) on the same seed and
    draws: the same losses as the eager smoke run, up to the fused kernels' rounding."""
    out = tmp_path / "compiled"
    result = _train(tmp_path, f"out_dir={out}", "denoiser.compile=true", smoke=WAN_SMOKE)
    assert result.returncode == 0, result.stderr

    def denoiser_losses(folder):
        rows = [line.split(",") for line in (folder / "loss_log.csv").read_text().splitlines()[1:]]
        return [float(loss) for phase, _, loss in rows if phase != "vae"]

    eager, compiled = denoiser_losses(wan_smoke), denoiser_losses(out)
    assert len(compiled) == len(eager) > 0
    assert compiled == pytest.approx(eager, rel=1e-3)
