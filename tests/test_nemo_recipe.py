"""NeMo's INT8 recipe on the tiny SDXL: Percentile Quant on convolution inputs with the amax NeMo's
and ModelOpt's example calibrator compute, Linear inputs at their max ranges for SmoothQuant, FP8 at
max as ModelOpt's example runs it, and checkpoints of the older recipe refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from sdquant.quantize.calibrate import max_abs, quantize_backbones
from sdquant.families.sd import SDXL
from sdquant.errors import UserError
from sdquant.load import load_prompts
from sdquant.runs.model import settle_checkpoint
from sdquant.runs.quantize import settle_quantize
from sdquant.workflow.quantize import run_quantize

from conftest import settled_model

N_STEPS = 4


class ExampleCalibrator:
    """The amax ModelOpt's diffusers example (and NeMo, for min-mean) computes for a convolution
    input, as its calibrator behaves: every call is one more step (call count modulo n_steps, one
    UNet call per step here); a step's first amax is kept and later ones are added (min-mean), or
    folded by min (global_min) or max (min-max, mean-max), in the activation's own dtype. The amax
    reads the first int(n_steps * percentile) steps, each min-mean sum divided by n_steps: their
    mean for mean-max, else their min. Plain max is the largest over those steps (at percentile 1,
    ModelOpt's max calibrator: the largest of all)."""

    def __init__(self, method: str, n_steps: int, percentile: float):
        self.method, self.n_steps, self.percentile = method, n_steps, percentile
        self.calls = 0
        self.per_step: dict[int, torch.Tensor] = {}

    def collect(self, x: torch.Tensor) -> None:
        amax = x.detach().abs().amax()
        step = self.calls % self.n_steps
        self.calls += 1
        if step not in self.per_step:
            self.per_step[step] = amax
        elif self.method == "global_min":
            self.per_step[step] = torch.minimum(self.per_step[step], amax)
        elif self.method in ("min-max", "mean-max", "max"):
            self.per_step[step] = torch.maximum(self.per_step[step], amax)
        else:
            self.per_step[step] = self.per_step[step] + amax

    def amax(self) -> torch.Tensor:
        steps = [self.per_step[step] for step in range(int(self.n_steps * self.percentile))]
        if self.method == "min-mean":
            steps = [value / self.n_steps for value in steps]
        stacked = torch.stack(steps)
        return {"mean-max": stacked.mean, "max": stacked.max}.get(self.method, stacked.min)()


def _calibrate_beside(pipe, cfg, observe: dict) -> None:
    """quantize_backbones on `pipe`, with `observe[name](input)` called on each named module's input."""
    handles = [module.register_forward_pre_hook(lambda _m, args, name=name: observe[name](args[0]))
               for name, module in pipe.unet.named_modules() if name in observe]
    try:
        quantize_backbones(pipe, SDXL, load_prompts(None, cfg.quantize.calib_size), settle_quantize(cfg).calibration.block, cfg.seed)
    finally:
        for handle in handles:
            handle.remove()


def _conv_names(unet) -> list[str]:
    return [name for name, module in unet.named_modules() if isinstance(module, torch.nn.Conv2d)]


@pytest.mark.parametrize("percentile", [1.0, 0.5])
@pytest.mark.parametrize("method", ["global_min", "min-max", "min-mean", "mean-max", "max"])
def test_convolution_ranges_equal_the_example_calibrators(tiny_pipeline, quantize_cfg, method, percentile):
    cfg = quantize_cfg("quantize.quant_level=3", f"quantize.collect_method={method}",
                       f"quantize.percentile={percentile}", f"quantize.n_steps={N_STEPS}")
    pipe = tiny_pipeline()
    references = {name: ExampleCalibrator(method, N_STEPS, percentile) for name in _conv_names(pipe.unet)}
    _calibrate_beside(pipe, cfg, {name: ref.collect for name, ref in references.items()})
    modules = dict(pipe.unet.named_modules())
    compared = 0
    for name, reference in references.items():
        quantizer = modules[name].input_quantizer
        if not quantizer.is_enabled:
            continue
        ours, theirs = quantizer.amax.float().reshape(()), reference.amax().reshape(())
        if method == "min-mean":
            # The example adds fp32 amaxes one after another; sdquant adds them exactly (float64,
            # so that data-parallel runs equal one process) and rounds once.
            assert torch.allclose(ours, theirs, rtol=2e-7, atol=0), (name, ours, theirs)
        else:
            assert torch.equal(ours, theirs), (name, ours, theirs)
        compared += 1
    assert compared >= 20


def test_default_int8_percentile_on_convolutions_and_max_for_smoothquant_on_linear(tiny_pipeline, quantize_cfg):
    cfg = quantize_cfg("quantize.quant_level=3", f"quantize.n_steps={N_STEPS}")
    assert (cfg.quantize.collect_method, cfg.quantize.percentile_layers, cfg.quantize.mean_divisor) == \
        ("min-mean", "auto", "n_steps")
    pipe = tiny_pipeline()
    modules = dict(pipe.unet.named_modules())
    linear = [name for name, module in modules.items() if isinstance(module, torch.nn.Linear)
              and not any(part in name for part in ("time_emb", "add_embedding", "time_embedding"))]
    channel_max: dict[str, torch.Tensor] = {}

    def keep_max(name):
        def observe(x):
            amax = max_abs(x, keep_last_dim=True)
            channel_max[name] = amax if name not in channel_max else torch.maximum(channel_max[name], amax)
        return observe

    convs = {name: ExampleCalibrator("min-mean", N_STEPS, 1.0) for name in _conv_names(pipe.unet)}
    _calibrate_beside(pipe, cfg, {**{name: ref.collect for name, ref in convs.items()},
                                  **{name: keep_max(name) for name in linear}})
    smoothed = [name for name in linear if modules[name].input_quantizer.is_enabled]
    assert len(smoothed) > 20
    for name in smoothed:
        quantizer = modules[name].input_quantizer
        # SmoothQuant's scales come from each channel's largest value over every step and prompt,
        # and the per-tensor range is the largest smoothed channel, as ModelOpt computes it.
        assert torch.equal(quantizer._amax_for_smoothing.float().flatten(), channel_max[name].flatten()), name
        expected = (channel_max[name].flatten() * quantizer.pre_quant_scale.float().flatten()).amax()
        assert torch.equal(quantizer.amax.float().reshape(()), expected.reshape(())), name
    for name, reference in convs.items():
        if modules[name].input_quantizer.is_enabled:
            assert torch.allclose(modules[name].input_quantizer.amax.float().reshape(()), reference.amax(), rtol=2e-7)


def test_percentile_on_every_layer_clips_linear_inputs_below_their_max(tiny_pipeline, quantize_cfg):
    """The older recipe, kept for research: min-mean on Linear inputs too gives narrower ranges."""
    def smoothing_ranges(*overrides):
        pipe = tiny_pipeline()
        _calibrate_beside(pipe, quantize_cfg("quantize.quant_level=3", f"quantize.n_steps={N_STEPS}", *overrides), {})
        return {name: module.input_quantizer._amax_for_smoothing.float()
                for name, module in pipe.unet.named_modules() if hasattr(module, "input_quantizer")
                and module.input_quantizer.is_enabled and hasattr(module.input_quantizer, "_amax_for_smoothing")}

    nemo, everywhere = smoothing_ranges(), smoothing_ranges("quantize.percentile_layers=all",
                                                            "quantize.mean_divisor=runs")
    assert nemo.keys() == everywhere.keys() and len(nemo) > 20
    assert all(bool((everywhere[name] <= nemo[name]).all()) for name in nemo)
    assert sum(bool((everywhere[name] < nemo[name]).any()) for name in nemo) > len(nemo) // 2


def test_fp8_calibrates_with_max_as_modelopts_example_unless_asked(tiny_pipeline, quantize_cfg):
    cfg = quantize_cfg("quantize.format=fp8", "quantize.quant_level=3", f"quantize.n_steps={N_STEPS}")
    pipe = tiny_pipeline()
    references = {name: ExampleCalibrator("max", N_STEPS, 1.0) for name in _conv_names(pipe.unet)}
    _calibrate_beside(pipe, cfg, {name: ref.collect for name, ref in references.items()})
    modules = dict(pipe.unet.named_modules())
    enabled = [name for name in references if modules[name].input_quantizer.is_enabled]
    assert enabled and all(torch.equal(modules[name].input_quantizer.amax.float().reshape(()),
                                       references[name].amax().reshape(())) for name in enabled)


def test_a_checkpoint_of_the_older_recipe_is_refused_in_one_line(quantize_cfg, tmp_path):
    folder = run_quantize(quantize_cfg("quantize.quant_level=1"))
    sidecar = json.loads((folder / "checkpoint.json").read_text())
    del sidecar["settings"]["quantize"]["percentile_layers"]
    (folder / "checkpoint.json").write_text(json.dumps(sidecar))
    with pytest.raises(UserError, match="calibrated by an sdquant older than NeMo's recipe.*quantize again"):
        settle_checkpoint(settled_model("tiny_sdxl"), "quantized_unet", str(folder))
