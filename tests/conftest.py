"""Shared fixtures: tiny models built once per session, and Hydra configs composed as the scripts do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from sdquant.config import register_schemas
from sdquant.families import scene_schemas
from sdquant.load import compute_dtype, load_pipeline, resolve_device

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
# Small calibration settings that still cover several steps and batches.
FAST_QUANTIZE = ["quantize.n_steps=4", "quantize.calib_size=4", "quantize.batch_size=2"]

register_schemas(scene_schemas())

# Under pytest-xdist (the README's `-n auto`) the workers share the machine's cores: one thread
# each, for torch here and for the scripts the tests start, instead of every worker claiming all.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("model_cache")
    os.environ["SDQUANT_CACHE"] = str(cache)
    return cache


def compose_config(config_name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides)


@pytest.fixture
def quantize_cfg(model_cache, tmp_path):
    """Composes conf/sd_xl_quantize.yaml for the tiny SDXL, writing under this test's tmp_path."""

    def make(*overrides: str, model: str = "tiny_sdxl"):
        return compose_config("sd_xl_quantize", [f"model={model}", f"out_dir={tmp_path / 'quantized'}",
                                                 "device=cpu", *FAST_QUANTIZE, *overrides])

    return make


@pytest.fixture
def tiny_pipeline(model_cache):
    """Loads a tiny pipeline through the real from_pretrained path."""

    def make(model: str = "tiny_sdxl"):
        cfg = compose_config("sd_xl_quantize", [f"model={model}"])
        device = resolve_device("cpu")
        return load_pipeline(cfg.model, device, compute_dtype(device))

    return make


@pytest.fixture
def run_script(model_cache, tmp_path):
    """Runs one of the three scripts as a user would, with Hydra's own output kept in tmp_path."""

    def run(script: str, *overrides: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(REPO / script), *overrides, f"hydra.run.dir={tmp_path / 'hydra'}"],
            capture_output=True, text=True, cwd=REPO, env=dict(os.environ), timeout=600)

    return run


def sdxl_profile_shapes(infer, trt, graph: str, input_dims: dict, vae_scale: int = 8) -> dict:
    """The engine profile export_trt.py builds for SDXL's graph `graph` at infer's image size."""
    from sdquant.export import engines
    from sdquant.families.sd import SDXL

    from sdquant.graphs.geometry import SampleGeometry

    sizes = SDXL.profile_axis_sizes(graph, SampleGeometry(1, infer.height, infer.width), {"vae_scale_factor": vae_scale},
                                    trt)
    return engines.profile_shapes(infer, trt, SDXL.network(graph), input_dims, sizes)


def sdxl_run_sizes(latent_height: int, latent_width: int, windows: int = 1) -> dict:
    """Every dynamic axis but the batch of SDXL's graphs in a run at this latent size and context."""
    from sdquant.families.sd.graphs import unet_axis_sizes

    return unet_axis_sizes(latent_height, latent_width, windows, None)


def infer_stages(cfg) -> dict:
    """The stages infer_trt.py builds for `cfg` (sdquant.assembly, from its settled run)."""
    from sdquant.assembly import assemble
    from sdquant.runs.infer import settle_infer

    return assemble(settle_infer(cfg).pipeline).stages


def refused_in_one_line(run, cfg, capsys) -> str:
    """Runs a script's flow as its entry point does; returns the one error line it exits with."""
    from sdquant.cli import exits_cleanly
    from sdquant.errors import EXIT_USER_ERROR

    with pytest.raises(SystemExit) as exit_info:
        exits_cleanly(run)(cfg)
    assert exit_info.value.code == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    return err


def save_random_lora(folder: Path, pipe, seed: int, targets: dict[str, list[str]], rank: int = 4) -> Path:
    """A PEFT LoRA with random, non-zero A and B on copies of `pipe`'s networks (component name ->
    target modules), saved the way diffusers' training scripts save one; returns the .safetensors file."""
    import copy

    import torch
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from sdquant import lora

    torch.manual_seed(seed)
    layers = {}
    for component, modules in targets.items():
        network = copy.deepcopy(getattr(pipe, component))
        network.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False, target_modules=modules))
        layers[f"{component}_lora_layers"] = convert_state_dict_to_diffusers(get_peft_model_state_dict(network))
    type(pipe).save_lora_weights(str(folder), safe_serialization=True, **layers)
    return folder / lora.DEFAULT_WEIGHT_NAME


def quantize_each_recipe(out: Path, overrides: list[str]) -> dict[str, str]:
    """FP8 levels 3 and 4 and INT8 level 3 checkpoints of one model (`overrides` pick it), by name."""
    from sdquant.workflow.quantize import run_quantize

    recipes = {"fp8_l3": ["quantize.format=fp8", "quantize.quant_level=3"],
               "fp8_l4": ["quantize.format=fp8", "quantize.quant_level=4"],
               "int8_l3": ["quantize.quant_level=3"]}
    return {name: run_quantize(compose_config("sd_xl_quantize", [*overrides, f"out_dir={out}", *recipe]))
            for name, recipe in recipes.items()}


def enabled_quantizers(model: str, checkpoint, group_of, attribute: str | None = None) -> "collections.Counter":
    """Enabled quantizers of a restored checkpoint of `model` (of its backbone `attribute`, for a model
    of several): attention's bmm and softmax ones by their kind, the others by group_of(the name of
    the layer they sit on)."""
    import collections

    from modelopt.torch.quantization.nn import TensorQuantizer

    backbones = restored_backbones(model, checkpoint)
    (backbone,) = backbones.values() if attribute is None else (backbones[attribute],)
    groups = collections.Counter()
    for name, module in backbone.named_modules():
        if isinstance(module, TensorQuantizer) and module.is_enabled:
            owner, kind = name.rsplit(".", 1)
            groups[kind if "bmm" in kind or "softmax" in kind else group_of(owner)] += 1
    return groups


def assert_int8_graph_runs_as_fake_quantization(out: Path, model: str, checkpoint: str, prompts: list[str],
                                                steps: int, *overrides: str) -> None:
    """Exports `checkpoint`'s INT8 backbone graph and has evaluate.py run it beside the checkpoint's
    fake quantization: their per-step errors agree."""
    import json

    import numpy as np

    from sdquant.export.onnx_graphs import onnx_path
    from sdquant.workflow.evaluate import run_evaluate
    from sdquant.workflow.export_trt import run_export

    run_export(compose_config("sd_xl_export", [f"model={model}", "device=cpu", f"infer.out_path={out / 'int8'}",
                                               "onnx.precision=fp32", "run_trt_export=false",
                                               f"quantized_unet={checkpoint}"]))
    report = run_evaluate(compose_config("sd_xl_evaluate", [
        f"model={model}", "device=cpu", f"out_path={out / 'quality'}", f"sampling.prompts={json.dumps(prompts)}",
        f"sampling.steps={steps}", *overrides, f"+variants.fake={checkpoint}",
        f"+variants.onnx={onnx_path(out / 'int8', 'transformer')}"]))
    fake, graph_run = report["variants"]["fake"], report["variants"]["onnx"]
    assert all(np.isfinite(row["psnr"]) for row in fake["per_prompt"])
    # ModelOpt rounds x*(127/amax), ONNX x/(amax/127): a handful of values round apart.
    steps_error = np.array(fake["step_error"]), np.array(graph_run["step_error"])
    assert np.abs(steps_error[0] - steps_error[1]).max() < 0.02 and steps_error[0].min() > 0


def assert_fp8_kernels_draw_as_fake_quantization(infer, out: Path, checkpoint: str) -> None:
    """The images `infer(folder, *overrides)` draws from `checkpoint` on the torch backend's FP8
    kernels are as far from the unquantized images as its fake quantization's, within half a dB
    (or within 45 dB of the fake quantization's own)."""
    from skimage.metrics import peak_signal_noise_ratio as psnr

    fake = infer(out / "fake", "backend=torch", f"quantized_unet={checkpoint}")
    kernels = infer(out / "kernels", "backend=torch", f"quantized_unet={checkpoint}", "torch_backend.quantized=fp8")
    reference = infer(out / "ref", "backend=torch")
    for ref, a, b in zip(reference, fake, kernels):
        assert abs(psnr(ref, a) - psnr(ref, b)) < 0.5 or psnr(a, b) > 45


def settled_model(model: str):
    """conf/model/<model>.yaml settled as the scripts settle it (its folder's configs read)."""
    from sdquant.config import settled_config
    from sdquant.runs.model import settle_model

    return settle_model(settled_config(compose_config("sd_xl_quantize", [f"model={model}"])).model, drawing=False)


def restored_backbones(model: str, folder, key: str = "quantized_backbone") -> dict:
    """The backbones of `model` (by attribute) restored from the quantize.py checkpoint in `folder`."""
    from sdquant.assembly import restored_backbones as restored
    from sdquant.runs.model import settle_checkpoint

    settled = settled_model(model)
    return restored(settled, settle_checkpoint(settled, key, str(folder)))


def flow_over(run, stages: dict, device=None):
    """The data flow of a settled infer_trt.py run's family over `stages` (its model's tokenizers and
    configs, its scheduler), on the CPU by default."""
    import torch

    from sdquant.families.pipeline import make_scheduler

    model = run.pipeline.model
    scheduler = make_scheduler(run.pipeline.scheduler, model.parts["scheduler_config"])
    return model.family.text_to_image(stages, model.parts, scheduler, device or torch.device("cpu"))
