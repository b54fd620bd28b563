"""The Python API (sdquant.api): a pipeline built once draws what infer_trt.py draws for the same
settings, serves later calls without loading or compiling again what it has, refuses a bad call in
one line before any work, and lets go of what it held when closed."""

from __future__ import annotations

import ast
import gc
import weakref
from pathlib import Path

import pytest
import torch

from sdquant import load as loading
from sdquant import report
from sdquant.api import load
from sdquant.errors import UserError
from sdquant.workflow.infer_trt import run_infer

from conftest import compose_config

PROMPT = "a red circle on the left and a blue square on the right"
COMMON = ["backend=torch", "device=cpu", "sampling.steps=3", f"sampling.prompts=['{PROMPT}']"]
# Each family's built-in or tiny model, at a size that keeps a CPU call short.
MODELS = {"tiny_sdxl": ["sampling.width=64", "sampling.height=64"], "scenes_flux": [], "tiny_sd3": [],
          "tiny_wan": ["sampling.num_frames=5"]}


@pytest.mark.parametrize("model", MODELS)
def test_the_api_draws_what_infer_trt_draws_bit_for_bit(model, tmp_path, model_cache, monkeypatch):
    drawn = []
    submit = report.ImageWriter.submit
    monkeypatch.setattr(report.ImageWriter, "submit",
                        lambda writer, samples, *rest: drawn.append(samples.clone()) or submit(writer, samples, *rest))
    overrides = [*COMMON, *MODELS[model]]
    run_infer(compose_config("sd_xl_trt_inference", [f"model={model}", f"out_path={tmp_path}", *overrides]))
    with load(model, overrides) as pipe:
        ours = pipe(PROMPT).samples
    (theirs,) = drawn
    assert ours.shape == theirs.shape and theirs.std() > 0.01
    assert torch.equal(ours, theirs)


def test_one_pipeline_serves_other_prompts_seeds_steps_and_batches_without_loading_or_compiling_again(
        model_cache, monkeypatch):
    from torch._dynamo.utils import counters

    loads = []
    original = loading.load_pipeline
    monkeypatch.setattr("sdquant.assembly.load_pipeline", lambda *args, **kw: loads.append(1) or original(*args, **kw))
    torch._dynamo.reset()
    pipe = load("tiny_sdxl", ["device=cpu", "sampling.width=64", "sampling.height=64"], backend="torch",
                torch_backend={"compile": True})

    def graphs() -> int:
        return counters["stats"]["unique_graphs"]

    first = pipe(["a lighthouse at dusk"], seed=1, steps=2).samples
    compiled = graphs()
    assert compiled > 0, "the first call compiles the UNet and the decoder"
    again = pipe(["a red fox in the snow"], seed=2, steps=3).samples
    assert graphs() == compiled, "another prompt, seed and step count at the same shapes reuse the compiled code"
    assert not torch.equal(first, again)
    pair = pipe(["a cat", "a dog"], seed=3, steps=2).samples
    assert pair.shape[0] == 2
    after_pair = graphs()
    pipe(["a paper boat"], seed=4, steps=4)
    pipe(["a cat", "a dog"], seed=5, steps=3)
    assert graphs() == after_pair, "batch sizes seen before compile nothing new"
    assert len(loads) == 1, "the model is loaded once"
    pipe.close()


def test_a_closed_pipeline_lets_go_of_its_modules(model_cache):
    pipe = load("tiny_sdxl", ["device=cpu", "sampling.width=64", "sampling.height=64"], backend="torch")
    pipe("a lighthouse at dusk", steps=1)
    (unet,) = pipe.modules.values()
    held = weakref.ref(unet)
    del unet
    pipe.close()
    gc.collect()
    assert held() is None


@pytest.mark.parametrize("asked, message", [
    ({"steps": 0}, "steps=0 must be a whole number, at least 1"),
    ({"height": 60}, "height=60 must be a positive multiple of 8"),
    ({"num_frames": 9}, "num_frames=9: model=tiny_sdxl draws images"),
    ({"guidance_scale_2": 2.0}, "guidance_scale_2=2.0: sdxl models have one backbone"),
    ({"scale": 2.0}, "scale is no setting of a call"),
    ({"cache": {"method": "deepcache", "interval": "2"}}, "cache.interval='2' must be int"),
    ({"cache": {"method": "taylorseer"}}, "cache.method=taylorseer: model=tiny_sdxl's unet takes none or deepcache"),
    ({"cache": {"method": "first_block", "backbone_full_steps": {"unet": 2}}},
     "cache.backbone_full_steps=.* must be a dict of backbone names to lists of whole numbers"),
])
def test_a_bad_call_is_refused_in_one_line_before_any_work(model_cache, asked, message):
    with load("tiny_sdxl", ["device=cpu"], backend="torch") as pipe:
        with pytest.raises(UserError, match=message):
            pipe("a lighthouse at dusk", **asked)


@pytest.mark.parametrize("asked, message", [
    ({"guidance_scale": "7"}, "guidance_scale='7' must be a number, 0 or more"),
    ({"guidance_scale": float("nan")}, "guidance_scale=nan must be a number"),
    ({"guidance_scale": True}, "guidance_scale=True must be a number"),
    ({"height": 64.0}, "height=64.0 must be a whole number"),
    ({"num_frames": "5"}, "num_frames='5' must be a whole number"),
    ({"seed": 2**70}, "seed=.* must be a whole number from 0 to 2\\*\\*63 - 1"),
])
def test_a_call_value_of_the_wrong_type_is_refused_in_one_line(model_cache, asked, message):
    with load("tiny_sdxl", ["device=cpu"], backend="torch") as pipe:
        with pytest.raises(UserError, match=message):
            pipe("a lighthouse at dusk", **asked)


def test_a_call_takes_the_pipelines_defaults_where_it_gives_none(model_cache):
    with load("tiny_wan", ["device=cpu", "sampling.num_frames=5", "sampling.steps=2"], backend="torch") as pipe:
        settings = pipe.settle("a red fox", num_frames=None, seed=None)
    assert (settings.frames, settings.steps, settings.seed) == (5, 2, 42)


def test_a_prompt_past_the_text_encoders_is_refused_under_long_prompts_error(model_cache):
    with load("tiny_sdxl", ["device=cpu"], backend="torch") as pipe:
        with pytest.raises(UserError, match="long_prompts=error: prompt .* is longer than CLIP's 77 tokens"):
            pipe("a lighthouse at dusk " * 40, long_prompts="error")


def test_a_per_call_cache_its_stages_cannot_take_is_refused(model_cache):
    """A cache hook decides on the host at each step: one captured CUDA graph cannot replay it, and
    the pipeline was built to capture its backbone."""
    with load("tiny_flux", ["device=cpu"], backend="torch", cuda_graph=True) as pipe:
        with pytest.raises(UserError, match="cache.method=first_block decides on the host at each step"):
            pipe("a red fox", steps=2, cache={"method": "first_block"})


def test_switching_the_step_cache_per_call_draws_what_a_pipeline_built_for_it_draws(model_cache):
    call = {"steps": 4, "seed": 3, "height": 64, "width": 64}
    deep = {"method": "deepcache", "interval": 2}
    with load("tiny_sdxl", ["device=cpu"], backend="torch") as pipe:
        drawn = [pipe("a lighthouse at dusk", **call, cache=cache).samples for cache in (deep, None, deep, None)]
    with load("tiny_sdxl", ["device=cpu"], backend="torch", sampling={"cache": deep}) as cached:
        built = cached("a lighthouse at dusk", **call).samples
    assert torch.equal(drawn[0], built) and torch.equal(drawn[2], built)
    assert torch.equal(drawn[1], drawn[3]) and not torch.equal(drawn[0], drawn[1])


def test_a_pipeline_already_in_memory_draws_what_the_loaded_one_draws(model_cache):
    from sdquant.api import from_pipeline

    from conftest import compose_config

    config = compose_config("sd_xl_quantize", ["model=tiny_sdxl"]).model
    pipe = loading.load_pipeline(config, torch.device("cpu"), torch.float32)
    call = {"steps": 3, "seed": 5, "height": 64, "width": 64}
    with from_pipeline(pipe, "sdxl") as ours, load("tiny_sdxl", ["device=cpu"], backend="torch") as loaded:
        assert torch.equal(ours("a red fox", **call).samples, loaded("a red fox", **call).samples)
    with pytest.raises(UserError, match="torch_backend.quantized=fp8 runs backbones quantized in memory"):
        from_pipeline(pipe, "sdxl", torch_backend={"quantized": "fp8"})


def test_a_wrong_key_or_type_in_the_settings_is_refused_in_one_line(model_cache):
    with pytest.raises(UserError, match="torch_backend"):
        load("tiny_sdxl", ["device=cpu"], torch_backend={"compiled": True})
    with pytest.raises(UserError, match="cuda_graph"):
        load("tiny_sdxl", ["device=cpu"], cuda_graph="sometimes")
    # A map's keys are free (the model's backbones, as `+key=...` names them on a command line), its
    # values still typed.
    with pytest.raises(UserError, match="'high' of type 'str' could not be converted to Float"):
        load("tiny_wan", ["device=cpu"], sampling={"cache": {"backbone_thresholds": {"transformer_2": "high"}}})


PACKAGE = Path(__file__).resolve().parents[1] / "sdquant"
# Where the Hydra config may still be handled: its schemas, each script's edge (the settle step,
# the workflows' run_* entries that hand it there) and the API, which composes one.
HYDRA_MODULES = {"sdquant/config.py", "sdquant/api.py"}


def test_no_module_below_the_settle_step_takes_the_hydra_config():
    """Below each script's edge the config is settled plain dataclasses: no module imports OmegaConf
    or Hydra but the schemas and the API, and a parameter named `cfg` (the composed config) is
    taken only by the settle functions and the workflows' run_* entries."""
    importing, taking, edges = [], [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE.parent).as_posix()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if any(module.split(".")[0] in ("omegaconf", "hydra") for module in modules) \
                        and name not in HYDRA_MODULES:
                    importing.append(name)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and "cfg" in [a.arg for a in node.args.args]:
                edge = (name.startswith("sdquant/runs/") and node.name.startswith("settle")) or \
                       (name.startswith("sdquant/workflow/") and node.name.startswith("run_")) or \
                       node.name == "settled_config"
                (edges if edge else taking).append(f"{name}:{node.name}")
    assert "sdquant/runs/infer.py:settle_infer" in edges, "the walk reads the settle functions"
    assert not importing, f"modules importing OmegaConf or Hydra below the edge: {importing}"
    assert not taking, f"functions taking the Hydra config below the edge: {taking}"
