"""Bad input for a video model, tried as a new user would: each is refused in one line naming the
key (or the folder's file) and what to do, exit code 2, before any work and before anything is
written. A geometry the experts cannot place, what a model folder declares, a calibration that
leaves an expert without a step, a model config's own values, an output path that is a file."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from sdquant.workflow.evaluate import run_evaluate
from sdquant.workflow.export_trt import run_export
from sdquant.workflow.infer_trt import run_infer
from sdquant.workflow.quantize import run_quantize

from conftest import compose_config, refused_in_one_line

SCRIPTS = {"infer": ("sd_xl_trt_inference", run_infer, "out_path"),
           "quantize": ("sd_xl_quantize", run_quantize, "out_dir"),
           "export": ("sd_xl_export", run_export, "infer.out_path"),
           "evaluate": ("sd_xl_evaluate", run_evaluate, "out_path")}
BASE = {"infer": ["backend=torch"], "quantize": ["quantize.format=fp8", "quantize.quant_level=3"], "export": [],
        "evaluate": ["+variants.self=null"]}


@pytest.fixture(autouse=True)
def built(model_cache, capsys):
    """tiny_wan built before the test's own output is read (the build shows its own progress)."""
    from sdquant.load import ensure_tiny_model

    ensure_tiny_model(compose_config("sd_xl_quantize", ["model=tiny_wan"]).model)
    capsys.readouterr()


def _refused(script: str, tmp_path, capsys, *overrides: str, model: str = "tiny_wan") -> str:
    config, run, out_key = SCRIPTS[script]
    out = tmp_path / "out"
    cfg = compose_config(config, [f"model={model}", "device=cpu", f"{out_key}={out}", *BASE[script], *overrides])
    message = refused_in_one_line(run, cfg, capsys)
    assert not out.exists(), "refused before anything was written"
    return message


@pytest.mark.parametrize("script, overrides, message", [
    # The experts' rotary tables hold 64 positions an axis in the tiny model: 65 latent frames or
    # patches a side passed every other rule and failed inside diffusers.
    ("infer", ["sampling.num_frames=257"], "sampling.num_frames=257: model=tiny_wan's experts place at most 64 latent "
                                           "frames .* choose 253 or less"),
    ("infer", ["sampling.height=2048"], "sampling.height=2048: .* at most 64 patches a side .* choose 1024 or less"),
    ("export", ["infer.num_frames=257"], "infer.num_frames=257: .* choose 253 or less"),
    ("quantize", ["quantize.num_frames=257"], "quantize.num_frames=257: .* choose 253 or less"),
    # The model config's own values were replaced by the family's defaults where they were 0.
    ("infer", ["model.num_frames=0"], "model.num_frames=0: model=tiny_wan's VAE takes 4k \\+ 1 frames"),
    ("infer", ["model.fps=0"], "model.fps=0: give the frames per second"),
    ("infer", ["model.height=40"], "model.height=40 must be a positive multiple of 16"),
    ("quantize", ["model.num_frames=0"], "model.num_frames=0:"),
    # A second scale with guidance off changes nothing, and was recorded as if it did.
    ("infer", ["sampling.guidance_scale=1", "sampling.guidance_scale_2=5"], "sampling.guidance_scale_2=5.0 has no "
                                                                           "effect"),
    # One step: the low-noise expert serves none and would be written with no ranges.
    ("quantize", ["quantize.n_steps=1", "quantize.calib_size=2", "quantize.batch_size=1"],
     "quantize.n_steps=1: model=tiny_wan's transformer_2 serves none of the 1 calibration steps"),
])
def test_a_value_the_model_cannot_run_is_refused_before_any_work(tmp_path, capsys, model_cache, script, overrides,
                                                                 message):
    assert re.search(message, _refused(script, tmp_path, capsys, *overrides))


@pytest.mark.parametrize("script", SCRIPTS)
def test_an_output_path_that_is_a_file_is_refused_before_any_work(tmp_path, capsys, model_cache, script):
    config, run, out_key = SCRIPTS[script]
    taken = tmp_path / "a_file"
    taken.write_text("mine")
    cfg = compose_config(config, ["model=tiny_wan", "device=cpu", f"{out_key}={taken}", *BASE[script]])
    assert f"{out_key}={taken} is a file: give a folder" in refused_in_one_line(run, cfg, capsys)
    assert taken.read_text() == "mine"


def _edited_folder(tmp_path, model_cache, edit: dict) -> str:
    """tiny_wan's folder copied with `edit` ({file: {key: value}}) written into its JSON files."""
    from sdquant.load import ensure_tiny_model

    source = ensure_tiny_model(compose_config("sd_xl_quantize", ["model=tiny_wan"]).model)
    folder = tmp_path / "edited"
    shutil.copytree(source, folder)
    for name, values in edit.items():
        path = folder / name
        path.write_text(json.dumps({**json.loads(path.read_text()), **values}))
    return str(folder)


@pytest.mark.parametrize("edit, message", [
    ({"model_index.json": {"boundary_ratio": 1.5}}, "model_index.json declares boundary_ratio=1.5"),
    ({"model_index.json": {"boundary_ratio": "high"}}, "model_index.json declares boundary_ratio='high'"),
    ({"vae/config.json": {"scale_factor_spatial": 0}}, "vae/config.json declares scale_factor_spatial=0"),
    ({"vae/config.json": {"scale_factor_temporal": 0}}, "vae/config.json declares scale_factor_temporal=0"),
    ({"transformer/config.json": {"rope_max_seq_len": 0}}, "declares rope_max_seq_len=0"),
    ({"scheduler/scheduler_config.json": {"num_train_timesteps": 0}}, "declares num_train_timesteps=0"),
])
@pytest.mark.parametrize("script", ["infer", "quantize"])
def test_what_a_model_folder_declares_that_the_flow_cannot_run_is_refused(tmp_path, capsys, model_cache, edit,
                                                                          message, script):
    folder = _edited_folder(tmp_path, model_cache, edit)
    assert message in _refused(script, tmp_path, capsys, f"model.source={folder}")


def test_a_larger_patch_in_the_experts_config_sets_the_size_multiple():
    from sdquant.families.wan import WAN

    assert WAN.size_multiple(8, {"patch_size": [1, 2, 2]}) == 16
    assert WAN.size_multiple(8, {"patch_size": [1, 4, 4]}) == 32


def test_a_graph_of_another_model_or_geometry_is_refused_from_its_record(tmp_path, model_cache):
    from sdquant.export.onnx_graphs import META_FILE
    from sdquant.graphs.geometry import SampleGeometry
    from sdquant.runs.model import check_graph_made_for, config_digest
    from sdquant.errors import UserError

    from conftest import settled_model

    model = settled_model("tiny_wan")
    graph = tmp_path / "transformer" / "model.onnx"
    graph.parent.mkdir()
    geometry = SampleGeometry(9, 32, 32)
    own = {"backbone_config": config_digest(model.parts["backbone_config"]), "traced_geometry": [9, 32, 32]}
    (graph.parent / META_FILE).write_text(json.dumps(own))
    named = f"engines.transformer={graph}"
    check_graph_made_for(graph, named, model, geometry)
    with pytest.raises(UserError, match="is fixed at 9 frames of 32x32 .* this run draws 5 frames of 32x32"):
        check_graph_made_for(graph, named, model, SampleGeometry(5, 32, 32))
    (graph.parent / META_FILE).write_text(json.dumps({**own, "backbone_config": "another"}))
    with pytest.raises(UserError, match="was exported from a model whose transformer differs from model=tiny_wan's"):
        check_graph_made_for(graph, named, model, geometry)
