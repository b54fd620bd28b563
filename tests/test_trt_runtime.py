"""The TensorRT runtime's decisions that need no GPU: which batch each stage asks of its engine (both
negative-prompt paths), the profile check, which TensorRT loads each engine, and the minimum versions.
The runtime itself runs in test_trt_runtime_gpu.py."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

import standin_tensorrt
from sdquant.export import engines
from sdquant.families.sd import SDXL
from sdquant.config import InferBlock, TrtBlock
from sdquant.errors import UserError
from sdquant.families.pipeline import SamplingSettings
from sdquant.families.sd.flow import SDXLTextToImage
from sdquant.families import family_of
from sdquant.runtime.stages import StageTimer
from sdquant.runtime.trt_stages import check_within_profiles, trt_stages
from sdquant.runs.infer import settle_infer

from conftest import compose_config, flow_over, sdxl_profile_shapes, sdxl_run_sizes

SDXL_DIMS = {"clip1": {"input_ids": [None, 77]}, "clip2": {"input_ids": [None, 77]},
             "unet_xl": {"x": [None, 4, None, None], "timesteps": [None], "context": [None, None, 2048],
                         "y": [None, 2816]},
             "vae": {"latent": [None, 4, None, None]}}


def _settings(prompts: int, negative_prompt: str, guidance_scale: float, images_per_prompt: int = 1,
              long_prompts: str = "truncate") -> SamplingSettings:
    return SamplingSettings(prompts=[f"prompt {i}" for i in range(prompts)], negative_prompt=negative_prompt,
                            steps=1, guidance_scale=guidance_scale, height=64, width=64, seed=0,
                            images_per_prompt=images_per_prompt, long_prompts=long_prompts)


class _BatchRecorder:
    """Runs a stage and notes how many samples it was called with."""

    def __init__(self, stage, name: str, seen: dict):
        self.stage, self.name, self.seen = stage, name, seen

    def __call__(self, **inputs):
        self.seen.setdefault(self.name, set()).add(next(iter(inputs.values())).shape[0])
        return self.stage(**inputs)


@pytest.mark.parametrize("model,negative_prompt,guidance_scale,images_per_prompt", [
    ("tiny_sdxl", "", 5.0, 1), ("tiny_sdxl", "blurry", 5.0, 1), ("tiny_sdxl", "", 1.0, 1),
    ("tiny_sdxl", "blurry", 1.0, 1), ("tiny_sd15", "", 5.0, 1), ("tiny_sd15", "", 1.0, 1),
    ("tiny_sdxl", "blurry", 5.0, 3), ("tiny_sd15", "", 5.0, 2)])
def test_stage_batches_are_what_the_data_flow_runs(tiny_pipeline, model, negative_prompt, guidance_scale,
                                                   images_per_prompt):
    pipe = tiny_pipeline(model)
    sdxl = model == "tiny_sdxl"
    seen = {}
    stages = {name: _BatchRecorder(stage, name, seen)
              for name, stage in family_of("sdxl" if sdxl else "sd15").torch_stages(pipe, torch.float32).items()}
    cfg = compose_config("sd_xl_trt_inference", [f"model={model}", "backend=torch"])
    pipeline = flow_over(settle_infer(cfg), stages)
    settings = _settings(2, negative_prompt, guidance_scale, images_per_prompt)
    images = pipeline(settings, StageTimer(torch.device("cpu")), progress=False)
    assert images.shape[0] == 2 * images_per_prompt
    assert {name: sizes.pop() for name, sizes in seen.items() if len(sizes) == 1} == pipeline.stage_batches(settings)
    if sdxl:
        zero_negative = negative_prompt == ""
        assert pipeline.stage_batches(settings)["clip1"] == (2 if zero_negative else 4), \
            "SDXL's empty negative prompt is zeros: the text encoders see the prompts only"


def _sdxl_pipeline() -> SDXLTextToImage:
    return SDXLTextToImage({}, [], None, types.SimpleNamespace(addition_time_embed_dim=256), 8,
                           torch.device("cpu"), "unet_xl")


def _check(profiles: dict, batches: dict, latent: tuple[int, int], windows: int = 1) -> None:
    """The profile check infer_trt.py runs, for SDXL's engines at this latent size and context."""
    check_within_profiles(profiles, batches, sdxl_run_sizes(*latent, windows),
                          {name: SDXL.network(name) for name in profiles})


@pytest.mark.parametrize("trt", [TrtBlock(), TrtBlock(static_batch=True)], ids=["dynamic", "static"])
@pytest.mark.parametrize("negative_prompt", ["", "blurry"])
def test_engines_built_for_a_run_admit_it(trt, negative_prompt):
    infer = InferBlock(batch_size=2, width=512, height=768)
    profiles = {name: sdxl_profile_shapes(infer, trt, name, dims) for name, dims in SDXL_DIMS.items()}
    settings = _settings(2, negative_prompt, 5.0)
    _check(profiles, _sdxl_pipeline().stage_batches(settings), (96, 64))


def test_static_text_encoders_take_the_prompts_alone_or_with_negatives():
    infer, static = InferBlock(batch_size=3), TrtBlock(static_batch=True)
    assert engines.batch_range(infer, static, SDXL.network("clip2")) == engines.BatchRange(3, 6, 6)
    assert engines.batch_range(infer, static, SDXL.network("unet_xl")) == engines.BatchRange(6, 6, 6)


def test_images_per_prompt_beyond_the_engines_batch_is_refused_before_any_work():
    infer, trt = InferBlock(batch_size=1, width=64, height=64), TrtBlock(max_batch_size=2)
    profiles = {name: sdxl_profile_shapes(infer, trt, name, dims) for name, dims in SDXL_DIMS.items()}
    _check(profiles, _sdxl_pipeline().stage_batches(_settings(1, "", 5.0, 2)), (8, 8))
    with pytest.raises(UserError, match=r"unet_xl engine, input x: this run needs shape \(6, 4, 8, 8\).*"
                                        r"sampling.num_images_per_prompt"):
        _check(profiles, _sdxl_pipeline().stage_batches(_settings(1, "", 5.0, 3)), (8, 8))


def test_chunked_prompts_longer_than_the_unet_profile_are_refused_naming_the_rebuild():
    infer = InferBlock(batch_size=1, width=64, height=64)
    unet = {"unet_xl": sdxl_profile_shapes(infer, TrtBlock(), "unet_xl", SDXL_DIMS["unet_xl"])}
    assert unet["unet_xl"]["context"][2] == (16, 154, 2048), "two CLIP windows by default"
    _check(unet, {"unet_xl": 2}, (8, 8), windows=2)
    with pytest.raises(UserError, match=r"input context: .*prompts need 3 CLIP windows.*trt.max_prompt_chunks=3"):
        _check(unet, {"unet_xl": 2}, (8, 8), windows=3)
    longer = sdxl_profile_shapes(infer, TrtBlock(max_prompt_chunks=3), "unet_xl", SDXL_DIMS["unet_xl"])
    assert longer["context"] == ((1, 77, 2048), (2, 77, 2048), (16, 231, 2048))


def test_profile_check_names_engine_input_shape_range_and_fix():
    # A text encoder built static for 2 samples (a batch of one with its negative prompt), as
    # builds before the zero-negative path was taken into account made it.
    profiles = {"clip1": {"input_ids": ((2, 77), (2, 77), (2, 77))}}
    zero_negative = _sdxl_pipeline().stage_batches(_settings(1, "", 5.0))
    with pytest.raises(UserError) as error:
        _check(profiles, {"clip1": zero_negative["clip1"]}, (128, 128))
    assert str(error.value).startswith("clip1 engine, input input_ids: this run needs shape (1, 77), but its "
                                       "profile admits (2, 77) to (2, 77): rebuild the engines with export_trt.py")
    unet = {"unet_xl": sdxl_profile_shapes(InferBlock(width=1024, height=1024), TrtBlock(), "unet_xl",
                                           SDXL_DIMS["unet_xl"])}
    with pytest.raises(UserError, match=r"input x: this run needs shape \(18, 4, 128, 128\).*trt.max_batch_size"):
        _check(unet, {"unet_xl": 18}, (128, 128))
    with pytest.raises(UserError, match=r"input x: this run needs shape \(2, 4, 128, 96\), but its profile admits "
                                        r"\(1, 4, 128, 128\) to \(16, 4, 128, 128\).*infer.width/infer.height"):
        _check(unet, {"unet_xl": 2}, (128, 96))


def _plan_with_record(folder, record: dict | None):
    plan = folder / "unet_xl.plan"
    plan.write_bytes(b"plan")
    if record is not None:
        (folder / engines.ENGINES_FILE).write_text(json.dumps({"unet_xl": record}))
    return plan


def installed_rtx():
    """tensorrt_rtx (the trt-rtx extra, which the tests' install has and a GPU machine's may not)."""
    return pytest.importorskip("tensorrt_rtx", reason='TensorRT-RTX (pip install -e ".[trt-rtx]") is not installed')


def test_each_engine_is_loaded_by_the_tensorrt_that_built_it(tmp_path, monkeypatch):
    tensorrt_rtx = installed_rtx()
    monkeypatch.setitem(sys.modules, "tensorrt", standin_tensorrt.module("10.13.0"))
    rtx = _plan_with_record(tmp_path, {"flavour": "tensorrt_rtx", "version": tensorrt_rtx.__version__})
    assert engines.engine_flavour(rtx).module is tensorrt_rtx, "TensorRT is installed too, but RTX built it"
    full = _plan_with_record(tmp_path, {"flavour": "tensorrt", "version": "10.13.0"})
    assert engines.engine_flavour(full).module is sys.modules["tensorrt"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert engines.engine_flavour(_plan_with_record(elsewhere, None)).name == "tensorrt", "no record: any installed"


def test_engine_of_a_missing_tensorrt_names_both(tmp_path, monkeypatch):
    tensorrt_rtx = installed_rtx()
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # not installed, wherever this runs
    plan = _plan_with_record(tmp_path, {"flavour": "tensorrt", "version": "10.13.0"})
    with pytest.raises(UserError, match=rf"unet_xl.plan was built by tensorrt 10.13.0, which is not installed here "
                                        rf"\(tensorrt_rtx {tensorrt_rtx.__version__} is\)"):
        engines.engine_flavour(plan)


@pytest.mark.parametrize("version,task,refused", [
    ("10.0.1", "running engines", True), ("10.1.0", "running engines", False),
    ("10.1.0", "FP8 engines", True), ("10.2.0", "FP8 engines", False),
    ("8.6.1", "building strongly typed engines", True), ("10.0.0", "building strongly typed engines", False),
    ("11.1.0", "FP8 engines", False)])
def test_minimum_tensorrt_versions(version, task, refused):
    flavour = engines.Flavour(standin_tensorrt.module(version), "tensorrt", version)
    if refused:
        with pytest.raises(UserError, match=rf"^{task} needs TensorRT >= \d+\.\d+, but tensorrt is {version}: install"):
            flavour.require(task)
    else:
        flavour.require(task)
    rtx = standin_tensorrt.module("1.0.0", "tensorrt_rtx")
    engines.Flavour(rtx, "tensorrt_rtx", "1.0.0").require(task)  # RTX has it all since 1.0


def test_fp8_engine_needs_tensorrt_10_2(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", standin_tensorrt.module("10.1.0"))
    plan = _plan_with_record(tmp_path, {"flavour": "tensorrt", "version": "10.1.0", "fp8": True})
    with pytest.raises(UserError, match="FP8 engines needs TensorRT >= 10.2, but tensorrt is 10.1.0"):
        engines.engine_flavour(plan)


def test_runtime_refuses_tensorrt_10_0_before_anything(tmp_path):
    flavour = engines.Flavour(standin_tensorrt.module("10.0.1"), "tensorrt", "10.0.1")
    with pytest.raises(UserError, match=r"running engines needs TensorRT >= 10.1, but tensorrt is 10.0.1"):
        trt_stages(flavour, {"unet": tmp_path / "unet.plan"}, ())
