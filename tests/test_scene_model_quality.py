"""The shipped scene models draw prompts they never saw, and FP8 level 4 (for the Wan clips, also with
its step cache) stays close to the unquantized model. Only bounds that hold on any CPU: oneDNN rounds
FP8 a little differently on each (an AMD EPYC flipped three of these 16 scenes where an Intel Xeon
flipped none), so how many prompts a recipe keeps is measured in the benchmarks on 128 of them, with
the CPU named beside each figure; here the images are held to a PSNR floor and the clips to margins
of several prompts."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from sdquant.quality import scenes
from sdquant.config import shipped_model_folder
from sdquant.workflow.evaluate import run_evaluate
from sdquant.workflow.quantize import run_quantize

from conftest import compose_config


@pytest.mark.parametrize("model", ["scenes_sdxl", "scenes_flux"])
def test_held_out_two_object_prompts_in_fp32_and_fp8(tmp_path, model):
    held_out = (Path(shipped_model_folder(model)) / "heldout_prompts.txt").read_text().splitlines()
    two_objects = [prompt for prompt in held_out if scenes.parse_caption(prompt).objects == 2][:16]
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(two_objects) + "\n")
    fp8 = run_quantize(compose_config("sd_xl_quantize", [
        f"model={model}", f"out_dir={tmp_path / 'quantized'}", "device=cpu", "quantize.format=fp8",
        "quantize.quant_level=4", "quantize.batch_size=8"]))
    report = run_evaluate(compose_config("sd_xl_evaluate", [
        f"model={model}", f"out_path={tmp_path / 'quality'}", "device=cpu", f"sampling.prompts_file={prompts_file}",
        "sampling.batch_size=16", "sampling.steps=20", f"+variants.fp8={fp8}"]))
    reference = report["reference"]["name"]
    assert reference == "fp32"
    # Measured 84-100% of these with every attribute of both objects right on two CPUs: the floor
    # only says the model draws the scenes it was trained for.
    assert report["adherence"][reference]["scored"] == 16
    assert report["adherence"][reference]["mean"]["two_objects"] >= 0.5
    # The mean over 16 images moves little when one scene flips (measured 35-41 dB on 128 prompts).
    psnr = statistics.fmean(min(row["psnr"], 100.0) for row in report["variants"]["fp8"]["per_prompt"])
    assert psnr >= 28, f"FP8 level 4 images at {psnr:.1f} dB from the unquantized ones"


# The Wan row the README headlines beside FP8 level 4: TaylorSeer over whole blocks, a full pass
# every 2 steps, after one full step an expert (benchmarks/quality_over_calibrations.py).
WAN_CACHE = "{method:taylorseer_blocks,interval:2,warmup:1}"
# How many of the 16 clips an 8-bit setting may draw wrong beyond the unquantized model, in all
# attributes, in the direction of motion alone, and in identity kept. Not the README's 3 points on
# 128 prompts: over 16 one clip is 6.25 points, and a CPU's last-bit roundings of FP8 flip one or
# another. Measured on an AMD EPYC: at most one clip lost in each, over three calibrations and the
# first again with oneDNN held to AVX2 (other kernels: the clip FP8 had lost came back).
WAN_CLIPS_MAY_LOSE = 3


def test_wan_clips_in_fp8_level_4_with_and_without_its_step_cache(tmp_path):
    """The Wan scene model's FP8 level-4 experts, run through the FP8 kernels' rounding as the README's
    Wan table runs them, alone and with its step cache, against the unquantized model on 8 held-out
    one-object and 8 two-object prompts: adherence, the direction of motion and the temporal figures
    within fixed margins of the unquantized model's. One small calibration serves both settings."""
    held_out = (Path(shipped_model_folder("scenes_wan")) / "heldout_prompts.txt").read_text().splitlines()
    # The file holds 64 one-object prompts, then 64 two-object ones.
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(held_out[:8] + held_out[64:72]) + "\n")
    fp8 = run_quantize(compose_config("sd_xl_quantize", [
        "model=scenes_wan", f"out_dir={tmp_path / 'quantized'}", "device=cpu", "quantize.format=fp8",
        "quantize.quant_level=4", "quantize.calib_size=8", "quantize.batch_size=8"]))
    report = run_evaluate(compose_config("sd_xl_evaluate", [
        "model=scenes_wan", f"out_path={tmp_path / 'quality'}", "device=cpu", f"sampling.prompts_file={prompts_file}",
        "sampling.batch_size=16", "sampling.steps=20", "torch_backend.quantized=fp8", f"+variants.fp8={fp8}",
        f"+variants.fp8_cached={fp8}", "+variant_cache={fp8_cached:" + WAN_CACHE + "}"]))
    reference = report["reference"]["name"]
    adherence = report["adherence"]
    assert reference == "fp32" and adherence[reference]["scored"] == 16
    assert "TaylorSeer over whole blocks" in report["variants"]["fp8_cached"]["source"]

    def clips_right(name: str, attribute: str) -> int:
        return round(adherence[name]["mean"][attribute] * 16)

    def identity_kept(name: str) -> int:
        return round(adherence[name]["temporal"]["identity_kept"] * 16)

    # Measured 12 of 16 with every attribute and the motion right, 16 in direction: the floors only
    # say the model draws the clips it was trained for.
    assert clips_right(reference, "all") >= 8 and clips_right(reference, "direction") >= 12
    for name in ("fp8", "fp8_cached"):
        for attribute in ("all", "direction"):
            assert clips_right(name, attribute) >= clips_right(reference, attribute) - WAN_CLIPS_MAY_LOSE, \
                (name, attribute, adherence[name]["mean"], adherence[reference]["mean"])
        assert identity_kept(name) >= identity_kept(reference) - WAN_CLIPS_MAY_LOSE
        # The README's temporal bounds: half a pixel more jitter (measured at most 0.17 more), one
        # level more flicker (measured never more than the unquantized model's).
        temporal, unquantized = adherence[name]["temporal"], adherence[reference]["temporal"]
        assert temporal["jitter"] <= unquantized["jitter"] + 0.5, (name, temporal, unquantized)
        assert temporal["flicker"] <= unquantized["flicker"] + 1.0, (name, temporal, unquantized)
        # Measured 38.1-40.0 dB from the unquantized clips.
        psnr = report["variants"][name]["mean"]["psnr"]
        assert psnr >= 32, f"{name} clips at {psnr:.1f} dB from the unquantized ones"
