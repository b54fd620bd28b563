"""Percentile Quant statistics on hand-made per-step sequences, and the step clock."""

from __future__ import annotations

import pytest
import torch
from diffusers import HeunDiscreteScheduler

from sdquant.quantize.calibrate import PercentileCalibrator, StepClock, StepStatistics, attach_clock
from sdquant.families import family_of

# amax seen at each step (rows) in each of three calibration batches (columns).
AMAX = [
    [4.0, 2.0, 6.0],   # step 0
    [3.0, 5.0, 1.0],   # step 1
    [8.0, 7.0, 9.0],   # step 2
    [0.5, 0.5, 0.5],   # step 3
]

# (percentile, method) -> the amax worked out by hand from AMAX.
EXPECTED = {
    (1.0, "global_min"): 0.5,          # min over steps of per-step min
    (1.0, "min-max"): 0.5,             # min over steps of per-step max (0.5 at step 3)
    (1.0, "min-mean"): 0.5,            # per-step means 4, 3, 8, 0.5
    (1.0, "mean-max"): (6 + 5 + 9 + 0.5) / 4,
    (0.75, "global_min"): 1.0,         # steps 0..2 only
    (0.75, "min-max"): 5.0,
    (0.75, "min-mean"): 3.0,
    (0.75, "mean-max"): (6 + 5 + 9) / 3,
    (0.5, "min-mean"): 3.0,
    (0.5, "mean-max"): 5.5,
    (1.0, "max"): 9.0,                 # ModelOpt's max calibration: the largest value anywhere
    (0.5, "max"): 6.0,                 # steps 0..1 only
}


def _calibrator(method: str, n_steps: int, percentile: float, clock: StepClock, axis=None, divisor=None):
    """`divisor`: None for the runs' true mean, else NeMo's n_steps (every step fed is served)."""
    per_run = divisor is None
    return PercentileCalibrator(8, axis, False, per_tensor=StepStatistics(method, percentile, per_run),
                                per_channel=StepStatistics(method, percentile, per_run), clock=clock)


def _feed(calibrator: PercentileCalibrator, clock: StepClock) -> None:
    for batch in range(3):
        for step, row in enumerate(AMAX):
            clock.step = step
            # A tensor whose absolute max is the wanted amax, with a negative value to check abs.
            calibrator.collect(torch.tensor([[-row[batch], row[batch] / 2], [0.1, 0.0]]))


@pytest.mark.parametrize("percentile,method", sorted(EXPECTED))
def test_amax_matches_hand_computation(percentile, method):
    clock = StepClock()
    calibrator = _calibrator(method, 4, percentile, clock)
    _feed(calibrator, clock)
    assert float(calibrator.compute_amax()) == pytest.approx(EXPECTED[(percentile, method)])


@pytest.mark.parametrize("divisor,expected", [(None, 4.0), (20, 12.0 / 20)])
def test_mean_divides_by_the_runs_or_by_nemos_n_steps(divisor, expected):
    """The true mean of 2, 4 and 6 is 4; NeMo divides their sum by n_steps (20), giving 0.6."""
    clock = StepClock()
    calibrator = _calibrator("min-mean", 20, 1.0, clock, divisor=divisor)
    for step in range(20):
        clock.step = step
        for value in (2.0, 4.0, 6.0):
            calibrator.collect(torch.tensor([value]))
    assert float(calibrator.compute_amax()) == pytest.approx(expected)


def test_per_channel_axis_keeps_one_amax_per_channel():
    clock = StepClock(step=0)
    calibrator = _calibrator("min-mean", 1, 1.0, clock, axis=-1)
    calibrator.collect(torch.tensor([[[1.0, -4.0], [2.0, 3.0]]]))
    calibrator.collect(torch.tensor([[[3.0, 0.0], [-1.0, 2.0]]]))
    assert calibrator.compute_amax().flatten().tolist() == pytest.approx([2.5, 3.0])


def _steps_seen(pipe, n_steps: int, **call) -> list[int]:
    clock = StepClock()
    seen = []
    hooks = [attach_clock(pipe, family_of("sdxl"), pipe.unet, clock),
             pipe.unet.register_forward_pre_hook(lambda *_: seen.append(clock.step))]
    try:
        pipe(prompt=["a red fox"], num_inference_steps=n_steps, output_type="latent",
             generator=torch.Generator().manual_seed(0), **call)
    finally:
        for hook in hooks:
            hook.remove()
    return [int(step) for step in seen]


def test_clock_counts_steps_with_batched_guidance(tiny_pipeline):
    pipe = tiny_pipeline()
    assert _steps_seen(pipe, 5, guidance_scale=5.0) == [0, 1, 2, 3, 4]


def test_clock_counts_steps_of_second_order_scheduler(tiny_pipeline):
    """Heun calls the UNet twice per step but at the same steps' noise levels."""
    pipe = tiny_pipeline()
    pipe.scheduler = HeunDiscreteScheduler.from_config(pipe.scheduler.config)
    seen = _steps_seen(pipe, 4, guidance_scale=5.0)
    assert len(seen) == 7  # 2 * 4 - 1 calls
    assert sorted(set(seen)) == [0, 1, 2, 3]
    assert seen == sorted(seen)


def test_clock_counts_steps_with_unbatched_guidance(tiny_pipeline):
    """Guidance run as two UNet calls per step (conditional, then unconditional) stays on one step."""
    pipe = tiny_pipeline("tiny_sd15")
    pipe.scheduler.set_timesteps(3)
    clock = StepClock()
    seen = []
    hooks = [attach_clock(pipe, family_of("sd15"), pipe.unet, clock),
             pipe.unet.register_forward_pre_hook(lambda *_: seen.append(clock.step))]
    sample = torch.zeros(1, 4, 8, 8)
    context = torch.zeros(1, 77, pipe.unet.config.cross_attention_dim)
    try:
        for t in pipe.scheduler.timesteps:
            for _ in ("conditional", "unconditional"):
                pipe.unet(sample, t, encoder_hidden_states=context)
    finally:
        for hook in hooks:
            hook.remove()
    assert [int(step) for step in seen] == [0, 0, 1, 1, 2, 2]
