"""Calibration stage: Percentile Quant over denoising steps, driven by the diffusers pipeline.

Each activation quantizer gets a PercentileCalibrator that keeps, per denoising step, the sum,
count, max and min of the amax it saw in every calibration batch. The step comes from a StepClock
that reads the timestep the UNet is called with, so it is right however many UNet calls a step
takes (guidance batched or not, second-order schedulers). The final amax is a statistic over the
first ``int(n_steps * percentile)`` steps, chosen by the collect method:

===========  ==========================  ==================
method       per step, over batches      over steps
===========  ==========================  ==================
global_min   min                         min
min-max      max                         min
min-mean     mean (sum / observations)   min
mean-max     max                         mean
===========  ==========================  ==================
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from .config import QuantizeBlock
from .errors import UserError
from .recipe import calibration_algorithm, quant_cfg_entries


@dataclass
class StepClock:
    """The current denoising step, set from the timestep the UNet is called with."""

    step: int | None = None
    _schedule: torch.Tensor | None = field(default=None, repr=False)

    def set_schedule(self, timesteps: torch.Tensor) -> None:
        # Second-order schedulers repeat timesteps (t0, t1, t1, t2, t2, ...): a noise level
        # evaluated twice still belongs to one step.
        ordered = []
        for t in timesteps.detach().float().cpu().tolist():
            if t not in ordered:
                ordered.append(t)
        self._schedule = torch.tensor(ordered)

    def observe(self, timestep) -> None:
        t = torch.as_tensor(timestep).detach().float().flatten()[0].cpu()
        self.step = int((self._schedule - t).abs().argmin())


def attach_clock(pipe, clock: StepClock):
    """Keeps `clock` on the step of every UNet call of `pipe`; returns the hook handle."""

    def before_unet(_module, args, kwargs):
        # The schedule is read at each call since the pipeline sets it at the start of each run.
        clock.set_schedule(pipe.scheduler.timesteps)
        clock.observe(kwargs["timestep"] if "timestep" in kwargs else args[1])

    return pipe.unet.register_forward_pre_hook(before_unet, with_kwargs=True)


def _modelopt_calibrator_base():
    from modelopt.torch.quantization.calib import _Calibrator

    return _Calibrator


class PercentileCalibrator(_modelopt_calibrator_base()):
    """ModelOpt calibrator that keeps per-step amax statistics; see the module docstring."""

    def __init__(self, num_bits=8, axis=None, unsigned=False, *, clock: StepClock,
                 n_steps: int, percentile: float, collect_method: str):
        super().__init__(num_bits, axis, unsigned)
        self._clock = clock
        self._steps_used = int(n_steps * percentile)
        self._collect_method = collect_method
        self.reset()

    def reset(self):
        # step -> {"sum", "count", "max", "min"}; tensors stay on the device, so collecting
        # never waits for the GPU.
        self.step_stats: dict[int, dict] = {}

    @torch.no_grad()
    def collect(self, x):
        from modelopt.torch.quantization import utils as quant_utils

        reduce_axis = quant_utils.convert_quantization_axis_to_reduce_axis(x, self._axis)
        amax = quant_utils.reduce_amax(x, axis=reduce_axis).detach().float()
        step = self._clock.step
        stats = self.step_stats.get(step)
        if stats is None:
            self.step_stats[step] = {"sum": amax.clone(), "count": 1, "max": amax.clone(),
                                     "min": amax.clone()}
            return
        stats["sum"] += amax
        stats["count"] += 1
        torch.maximum(stats["max"], amax, out=stats["max"])
        torch.minimum(stats["min"], amax, out=stats["min"])

    def compute_amax(self):
        return amax_from_step_stats(self.step_stats, self._steps_used, self._collect_method)


def per_step_statistic(stats: dict, collect_method: str) -> torch.Tensor:
    if collect_method == "global_min":
        return stats["min"]
    if collect_method == "min-mean":
        return stats["sum"] / stats["count"]
    return stats["max"]


def amax_from_step_stats(step_stats: dict, steps_used: int, collect_method: str):
    """The final amax from per-step statistics; None when no step in range was seen."""
    values = [per_step_statistic(step_stats[step], collect_method)
              for step in range(steps_used) if step in step_stats]
    if not values:
        return None
    stacked = torch.stack(values)
    if collect_method == "mean-max":
        return stacked.mean(dim=0)
    return stacked.min(dim=0).values


def _is_activation_quantizer(name: str) -> bool:
    return not name.endswith("weight_quantizer")


def install_percentile_calibrators(unet, block: QuantizeBlock, clock: StepClock) -> int:
    """Puts a PercentileCalibrator on every enabled activation quantizer; returns how many."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    installed = 0
    for name, module in unet.named_modules():
        if not (isinstance(module, TensorQuantizer) and module.is_enabled):
            continue
        if not _is_activation_quantizer(name) or module._constant_amax is not None:
            continue
        module._calibrator = PercentileCalibrator(
            module._num_bits, module._axis, module._unsigned, clock=clock,
            n_steps=block.n_steps, percentile=block.percentile,
            collect_method=block.collect_method,
        )
        installed += 1
    return installed


@dataclass
class CalibrationResult:
    seconds: float
    batches: int
    unet_calls: int
    algorithm: dict


def calibration_batches(prompts: list[str], batch_size: int) -> list[list[str]]:
    return [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]


def pause_weight_calibration(unet) -> None:
    """ModelOpt has calibrated the weights before the loop starts; collecting them again at every
    UNet call would only add a device-to-host sync per layer (its max calibrator checks for NaN)."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    for name, module in unet.named_modules():
        if isinstance(module, TensorQuantizer) and name.endswith("weight_quantizer"):
            module.disable_calib()


def make_forward_loop(pipe, prompts: list[str], block: QuantizeBlock, seed: int, counter: dict):
    """The loop ModelOpt calls: the real pipeline over every batch, latents only (no VAE)."""

    def forward_loop(unet):
        pause_weight_calibration(unet)
        batches = calibration_batches(prompts, block.batch_size)
        device = pipe.unet.device
        for index, batch in enumerate(tqdm(batches, desc="calibrating", unit="batch")):
            generator = torch.Generator(device=device).manual_seed(seed + index)
            pipe(prompt=batch, num_inference_steps=block.n_steps,
                 guidance_scale=block.guidance_scale, height=block.height, width=block.width,
                 generator=generator, output_type="latent")
            counter["batches"] += 1

    return forward_loop


def quantize_unet(pipe, prompts: list[str], block: QuantizeBlock, seed: int) -> CalibrationResult:
    """Inserts quantizers into `pipe.unet` and calibrates them in place."""
    import modelopt.torch.quantization as mtq

    unet = pipe.unet
    mtq.quantize(unet, {"quant_cfg": quant_cfg_entries(block.format, block.quant_level),
                        "algorithm": None})
    clock = StepClock()
    install_percentile_calibrators(unet, block, clock)
    counter = {"batches": 0, "unet_calls": 0}

    def count_call(*_):
        counter["unet_calls"] += 1

    hooks = [attach_clock(pipe, clock), unet.register_forward_pre_hook(count_call)]
    algorithm = calibration_algorithm(block.format, block.quant_level, block.alpha)
    start = time.perf_counter()
    try:
        mtq.calibrate(unet, algorithm, make_forward_loop(pipe, prompts, block, seed, counter))
    except torch.OutOfMemoryError as error:
        raise UserError(
            f"the GPU ran out of memory while calibrating with quantize.batch_size="
            f"{block.batch_size}: lower quantize.batch_size"
        ) from error
    finally:
        for hook in hooks:
            hook.remove()
    return CalibrationResult(time.perf_counter() - start, counter["batches"],
                             counter["unet_calls"], algorithm)


def activation_amax(unet) -> dict[str, float]:
    """Per-tensor amax of every enabled activation quantizer, by quantizer name."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    found = {}
    for name, module in unet.named_modules():
        if (isinstance(module, TensorQuantizer) and module.is_enabled
                and _is_activation_quantizer(name) and module.amax is not None):
            found[name] = float(module.amax.float().max())
    return found


def amax_summary(amax: dict[str, float]) -> dict:
    values = sorted(amax.values())
    if not values:
        return {"quantizers": 0}
    finite = [v for v in values if math.isfinite(v)]
    return {"quantizers": len(values), "min": values[0], "median": values[len(values) // 2],
            "max": values[-1], "non_finite": len(values) - len(finite)}
