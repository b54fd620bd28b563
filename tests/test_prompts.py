"""Prompts: several images of one prompt, each with its own seed; prompts past CLIP's 77 tokens, cut
with the dropped words said once (inference, evaluation, calibration) or encoded window by window."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from sdquant.load import pipeline_parts
from sdquant.families.pipeline import SamplingSettings, TextToImage, dropped_words, prompt_windows, say_truncated
from sdquant.families.sd import SDXL
from sdquant.runtime.stages import StageTimer
from sdquant.workflow.evaluate import run_evaluate
from sdquant.workflow.export_trt import run_export
from sdquant.runs.infer import settle_infer
from sdquant.workflow.infer_trt import run_infer
from sdquant.workflow.quantize import run_quantize

from conftest import compose_config, flow_over, refused_in_one_line

# The tiny models' tokenizer spells every letter and mark as one token: this prompt takes 79, and
# cutting it to CLIP's window drops its last 4, "sky,".
LONG = "a watercolor painting of a red fox in fresh snow " + "under a pale winter sky, " * 2
DROPPED = "sky ,"
SHORT = "a red fox"
CPU = torch.device("cpu")


def _infer(out, *overrides, backend="torch", graphs=None):
    plans = [f"{name}={graphs}/plan/{name}.plan" for name in ("clip1", "clip2", "unet_xl", "vae")] if graphs else []
    return run_infer(compose_config("sd_xl_trt_inference", [
        "model=tiny_sdxl", f"backend={backend}", "device=cpu", f"out_path={out}", "sampling.steps=3",
        "sampling.width=64", "sampling.height=64", "num_warmup_runs=0", *plans, *overrides]))


def _png(path) -> tuple[np.ndarray, dict]:
    with Image.open(path) as image:
        return np.asarray(image).astype(np.int16), dict(image.text)


def _tiny_sdxl(tiny_pipeline) -> TextToImage:
    cfg = compose_config("sd_xl_trt_inference", ["model=tiny_sdxl", "backend=torch"])
    return flow_over(settle_infer(cfg), SDXL.torch_stages(tiny_pipeline(), torch.float32))


def _settings(prompts: list[str], **options) -> SamplingSettings:
    return SamplingSettings(prompts=prompts, negative_prompt="", steps=2, guidance_scale=5.0, height=64, width=64,
                            seed=7, **options)


@pytest.mark.parametrize("scheduler", ["euler", "euler_a"])
def test_each_image_of_a_prompt_has_its_own_seed_as_if_made_alone(tmp_path, model_cache, scheduler):
    # euler_a draws noise at every step: each image's from its own generator.
    _infer(tmp_path / "four", 'sampling.prompts=["a cat","a dog"]', "sampling.batch_size=2",
           "sampling.num_images_per_prompt=2", f"sampling.scheduler={scheduler}")
    images = [_png(tmp_path / "four" / f"image_000_{index:02d}.png") for index in range(4)]
    assert [info["prompt"] for _, info in images] == ["a cat", "a cat", "a dog", "a dog"]
    assert [info["seed"] for _, info in images] == ["42", "43", "44", "45"]
    assert not np.array_equal(images[0][0], images[1][0]), "two images of one prompt differ"
    _infer(tmp_path / "alone", 'sampling.prompts=["a dog"]', "sampling.seed=45", f"sampling.scheduler={scheduler}")
    alone, info = _png(tmp_path / "alone/image_000_00.png")
    assert info["seed"] == "45"
    assert np.abs(alone - images[3][0]).max() <= 1, "the fourth image is the dog made alone with seed 45"


def test_later_batches_continue_the_seeds(tmp_path, model_cache):
    latency = _infer(tmp_path, 'sampling.prompts=["a cat","a dog","a cow"]', "sampling.batch_size=2",
                     "sampling.num_images_per_prompt=2")
    assert latency["images_per_run"] == 4
    seeds = {path.name: _png(path)[1]["seed"] for path in sorted(tmp_path.glob("image_*.png"))}
    assert seeds == {"image_000_00.png": "42", "image_000_01.png": "43", "image_000_02.png": "44",
                     "image_000_03.png": "45", "image_001_00.png": "46", "image_001_01.png": "47"}


def test_evaluate_scores_every_image_of_every_prompt(tmp_path, model_cache):
    report = run_evaluate(compose_config("sd_xl_evaluate", [
        "model=tiny_sdxl", "device=cpu", f"out_path={tmp_path}", 'sampling.prompts=["a cat","a dog"]',
        "sampling.num_images_per_prompt=2", "sampling.steps=2", "sampling.width=64", "sampling.height=64",
        "+variants.same=null"]))
    rows = report["variants"]["same"]["per_prompt"]
    assert [row["prompt"] for row in rows] == ["a cat", "a cat", "a dog", "a dog"]
    with Image.open(tmp_path / "grid.png") as grid:
        assert grid.size == (64 * 2, 64 * 4)


def test_first_window_is_what_the_tokenizer_truncates_to(model_cache):
    tokenizer = pipeline_parts(compose_config("sd_xl_trt_inference", ["model=tiny_sdxl"]).model)["tokenizers"][0]
    windows = prompt_windows(tokenizer, LONG)
    truncated = tokenizer(LONG, padding="max_length", max_length=77, truncation=True).input_ids
    assert len(windows) == 2 and windows[0] == truncated
    assert prompt_windows(tokenizer, SHORT) == [tokenizer(SHORT, padding="max_length", max_length=77).input_ids]
    assert dropped_words([tokenizer], LONG) == DROPPED and dropped_words([tokenizer], SHORT) == ""
    assert tokenizer.decode(windows[1], skip_special_tokens=True) == DROPPED, "the second window holds the rest"


def test_a_cut_prompt_is_said_once_with_its_dropped_words(tmp_path, model_cache, capsys):
    _infer(tmp_path, f"sampling.prompts={json.dumps([LONG, SHORT])}", "num_timed_runs=2", "num_warmup_runs=1")
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: prompt")]
    assert len(warnings) == 1, "once, though the prompt runs four times"
    assert f"dropping {DROPPED!r}" in warnings[0] and "sampling.long_prompts=chunk keeps them" in warnings[0]


def test_long_prompts_error_refuses_a_cut_prompt_before_any_work(tmp_path, model_cache, capsys):
    err = refused_in_one_line(run_infer, compose_config("sd_xl_trt_inference", [
        "model=tiny_sdxl", "backend=torch", "device=cpu", f"out_path={tmp_path / 'images'}",
        f"sampling.prompts={json.dumps([SHORT, LONG])}", "sampling.long_prompts=error"]), capsys)
    assert err.startswith("error: sampling.long_prompts=error: prompt 'a watercolor") and f"{DROPPED!r}" in err
    assert "CLIP's 77 tokens" in err and "sampling.long_prompts=truncate" in err
    assert not (tmp_path / "images").exists()
    _infer(tmp_path / "short", f"sampling.prompts={json.dumps([SHORT])}", "sampling.long_prompts=error")
    assert (tmp_path / "short" / "image_000_00.png").is_file(), "a prompt that fits runs"


def test_chunked_prompts_join_the_windows_and_leave_short_prompts_as_they_were(tiny_pipeline, capsys):
    pipeline = _tiny_sdxl(tiny_pipeline)
    timer = StageTimer(CPU)
    chunked, _ = pipeline.encode(_settings([LONG, SHORT], long_prompts="chunk"), timer)
    assert "warning" not in capsys.readouterr().err, "chunking cuts nothing"
    assert chunked.shape[:2] == (4, 154), "zero negatives, then both prompts, each two windows long"
    assert torch.equal(chunked[:2], torch.zeros_like(chunked[:2]))
    cut, _ = pipeline.encode(_settings([LONG]), timer)
    assert cut.shape[1] == 77
    assert torch.allclose(chunked[2, :77], cut[1], atol=1e-5), "the first window is the cut prompt's embedding"
    assert pipeline.context_windows(_settings([SHORT], long_prompts="chunk")) == 1
    short, _ = pipeline.encode(_settings([SHORT], long_prompts="chunk"), timer)
    assert torch.equal(short, pipeline.encode(_settings([SHORT]), timer)[0])


def test_chunked_long_prompt_runs_through_onnx_runtime_as_through_torch(tmp_path, model_cache):
    graphs = tmp_path / "graphs"
    run_export(compose_config("sd_xl_export", ["model=tiny_sdxl", f"infer.out_path={graphs}", "device=cpu",
                                               "onnx.precision=fp32", "run_trt_export=false"]))
    prompt = f"sampling.prompts={json.dumps([LONG])}"
    _infer(tmp_path / "ort", prompt, "sampling.long_prompts=chunk", backend="onnxruntime", graphs=graphs)
    _infer(tmp_path / "torch", prompt, "sampling.long_prompts=chunk")
    _infer(tmp_path / "cut", prompt)
    ort, torch_backend, cut = (_png(tmp_path / name / "image_000_00.png")[0] for name in ("ort", "torch", "cut"))
    assert np.abs(ort - torch_backend).max() <= 2
    assert np.abs(ort - cut).max() > 2, "the words past the first window change the image"


def test_calibration_counts_cut_prompts_in_sidecar_and_summary(quantize_cfg, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join([LONG, SHORT, LONG + " at dawn", SHORT + " at dusk"]) + "\n")
    folder = run_quantize(quantize_cfg(f"prompts_file={prompts}", "quantize.n_steps=2"))
    sidecar = json.loads((folder / "checkpoint.json").read_text())
    assert sidecar["calibration"]["truncated_prompts"] == 2
    captured = capsys.readouterr()
    assert sum(line.startswith("warning: prompt") for line in captured.err.splitlines()) == 2
    assert "2 of 4 calibration prompts are longer than CLIP's 77 tokens" in captured.out


def test_say_truncated_names_each_prompt_once(model_cache, capsys):
    tokenizer = pipeline_parts(compose_config("sd_xl_trt_inference", ["model=tiny_sdxl"]).model)["tokenizers"][0]
    told: set[str] = set()
    assert say_truncated([tokenizer], [LONG, SHORT, LONG], told, "keep") == 1
    assert say_truncated([tokenizer], [LONG], told, "keep") == 1
    assert len(capsys.readouterr().err.splitlines()) == 1


@pytest.mark.parametrize("model, count", [("scenes_sdxl", 128), ("tiny_sdxl", 4)])
def test_evaluate_without_prompts_takes_the_models_own(model, count, model_cache):
    """A scene model is evaluated on its held-out prompts (scored for adherence); another model on
    the package's photo prompts; given prompts win over both."""
    from sdquant.config import settled_config
    from sdquant.runs.sample import prompt_batches

    app = settled_config(compose_config("sd_xl_evaluate", [f"model={model}"]))
    assert sum(len(prompts) for prompts in prompt_batches(app.sampling, app.model)) == count
    app = settled_config(compose_config("sd_xl_evaluate", [f"model={model}", 'sampling.prompts=["a cat"]']))
    assert prompt_batches(app.sampling, app.model) == [["a cat"]]
