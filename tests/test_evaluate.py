"""evaluate.py on the tiny SDXL: self-check, quantized and ONNX variants, optional metrics, bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch
from PIL import Image

from sdquant.assembly import assemble
from sdquant.errors import EXIT_USER_ERROR, UserError
from sdquant.runs.evaluate import settle_evaluate
from sdquant.workflow.evaluate import evaluate, run_evaluate
from sdquant.workflow.export_trt import run_export
from sdquant.workflow.quantize import run_quantize

from conftest import compose_config

PROMPTS = ["a red fox in the snow, watercolor", "a lighthouse at dusk"]
SIZE = 64
STEPS = 4


def _evaluate(out, *overrides):
    return run_evaluate(compose_config("sd_xl_evaluate", [
        "model=tiny_sdxl", f"out_path={out}", "device=cpu", f"sampling.prompts={json.dumps(PROMPTS)}",
        f"sampling.steps={STEPS}", f"sampling.width={SIZE}", f"sampling.height={SIZE}", *overrides]))


@pytest.fixture(scope="module")
def int8_checkpoint(tmp_path_factory, model_cache):
    out = tmp_path_factory.mktemp("quantized")
    return run_quantize(compose_config("sd_xl_quantize", [
        "model=tiny_sdxl", f"out_dir={out}", "device=cpu", "quantize.n_steps=4", "quantize.calib_size=4",
        "quantize.batch_size=2", "quantize.quant_level=3"]))


@pytest.fixture(scope="module")
def unet_onnx(tmp_path_factory, model_cache):
    out = tmp_path_factory.mktemp("graphs")
    run_export(compose_config("sd_xl_export", ["model=tiny_sdxl", f"infer.out_path={out}", "device=cpu",
                                               "onnx.precision=fp32", "run_trt_export=false"]))
    return out / "onnx" / "unet_xl" / "model.onnx"


@pytest.mark.parametrize("scheduler", ["euler", "euler_a"])
def test_identical_unet_gives_infinite_psnr_unit_ssim_and_zero_step_error(tmp_path, tiny_pipeline, scheduler, capsys):
    # The tiny model is built (with diffusers' own progress bars) before the output under test.
    tiny_pipeline()
    capsys.readouterr()
    # euler_a draws noise at every step: identical images also prove it is drawn from the run's seed.
    report = _evaluate(tmp_path, "+variants.same=null", f"sampling.scheduler={scheduler}")
    progress = capsys.readouterr().err
    assert "fp32: 2/2 prompt batches" in progress and "same: 2/2 prompt batches" in progress
    assert "denoising" not in progress and "\r" not in progress, "one plain line per loop, none nested"
    same = report["variants"]["same"]
    assert [row["psnr"] for row in same["per_prompt"]] == [math.inf] * len(PROMPTS)
    assert [row["ssim"] for row in same["per_prompt"]] == pytest.approx([1.0] * len(PROMPTS))
    assert same["step_error"] == [0.0] * STEPS
    assert json.loads((tmp_path / "quality.json").read_text())["variants"]["same"]["mean"]["psnr"] == "inf"


def test_int8_and_onnx_variants_give_finite_worse_scores_and_a_grid(tmp_path, int8_checkpoint, unet_onnx):
    report = _evaluate(tmp_path, f"+variants.int8={int8_checkpoint}", f"+variants.onnx_fp32={unet_onnx}",
                       "sampling.batch_size=2")
    int8, onnx = report["variants"]["int8"], report["variants"]["onnx_fp32"]
    for row in int8["per_prompt"]:
        assert math.isfinite(row["psnr"]) and row["ssim"] < 1.0
    assert len(int8["step_error"]) == STEPS and all(error > 1e-3 for error in int8["step_error"])
    # The fp32 ONNX graph of the same UNet differs from eager PyTorch only by float rounding:
    # far closer than 8-bit quantization gets.
    assert all(error < 1e-4 for error in onnx["step_error"])
    assert onnx["mean"]["psnr"] > int8["mean"]["psnr"] + 20
    with Image.open(tmp_path / "grid.png") as grid:
        assert grid.size == (SIZE * 3, SIZE * len(PROMPTS))
    text = (tmp_path / "quality.md").read_text()
    assert "| int8 |" in text and "| onnx_fp32 |" in text and f"| {STEPS - 1} |" in text
    # The reference is named by what ran (fp32 on a CPU), and the scheduler that ran is named too.
    assert text.startswith("# Quality against the unquantized backbone (fp32)") and f"{STEPS} steps (euler)" in text


def _tiny_clip(folder):
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from sdquant.families.components import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    config = CLIPConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 77},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
        projection_dim=16)
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(folder)
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=processor, tokenizer=tokenizer).save_pretrained(folder)
    return folder


def test_a_variant_is_drawn_with_the_pipeline_the_caller_built(tmp_path, model_cache):
    run = settle_evaluate(compose_config("sd_xl_evaluate", [
        "model=tiny_sdxl", f"out_path={tmp_path}", "device=cpu", f"sampling.prompts={json.dumps(PROMPTS[:1])}",
        f"sampling.steps={STEPS}", f"sampling.width={SIZE}", f"sampling.height={SIZE}", "+variants.peer=null"]))
    built = assemble(run.reference)
    # A peer library's change to the backbone, which no config names: its Linear weights in bf16.
    with torch.no_grad():
        for module in built.modules["unet"].modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(module.weight.to(torch.bfloat16).float())
    with pytest.raises(UserError, match="built pipelines for pear: no such variant"):
        evaluate(run, built={"pear": built})
    drawn = evaluate(run, built={"peer": built})["variants"]["peer"]
    # Drawn as an unquantized variant alone, it would be the reference again: infinite PSNR, no step error.
    assert 15 < drawn["mean"]["psnr"] < math.inf and all(error > 0 for error in drawn["step_error"])


def test_clip_score_from_a_local_model_and_notes_for_missing_weights(tmp_path, model_cache):
    clip = _tiny_clip(tmp_path / "clip")
    report = _evaluate(tmp_path / "with_clip", "+variants.same=null", f"metrics.clip_model={clip}")
    scores = [row["clip"] for row in report["variants"]["same"]["per_prompt"]]
    assert len(scores) == len(PROMPTS) and all(0.0 <= s <= 100.0 for s in scores)
    assert report["reference"]["clip"] == pytest.approx(scores)
    # This machine has no torchvision or LPIPS backbone weights: skipped, with the reason.
    assert any(note.startswith("LPIPS skipped") for note in report["notes"])

    report = _evaluate(tmp_path / "without", "+variants.same=null", "metrics.clip_model=/nonexistent/clip")
    assert "clip" not in report["variants"]["same"]["per_prompt"][0]
    assert any("CLIP score skipped: /nonexistent/clip" in note for note in report["notes"])
    assert "CLIP score skipped" in (tmp_path / "without" / "quality.md").read_text()


@pytest.mark.parametrize("overrides,message", [
    ([], "no variants to evaluate"),
    (["+variants.int8=/nonexistent/ckpt"], "variants.int8=/nonexistent/ckpt: no such file or folder"),
    (["metrics.lpips_net=resnet", "+variants.same=null"], "metrics.lpips_net='resnet' is unknown"),
    (["sampling.width=100", "+variants.same=null"],
     "sampling.width=100 must be a positive multiple of 8, the model's VAE scale factor"),
    (["torch_backend.tune_kernels=true", "+variants.same=null"], "torch_backend.compile, .tune_kernels: evaluate.py"),
])
def test_bad_evaluate_settings_are_refused(tmp_path, model_cache, overrides, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        _evaluate(tmp_path / "out", *overrides)
    assert not (tmp_path / "out").exists()


def test_unknown_variant_file_is_refused_by_the_script(run_script, tmp_path):
    stray = tmp_path / "unet.bin"
    stray.write_bytes(b"")
    result = run_script("evaluate.py", "model=tiny_sdxl", f"+variants.x={stray}", f"out_path={tmp_path / 'q'}")
    assert result.returncode == EXIT_USER_ERROR
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: variants.x={stray} is not a quantize.py")
    assert "Traceback" not in result.stderr and not (tmp_path / "q").exists()
