"""Calibration stage: Percentile Quant over denoising steps, driven by the diffusers pipeline.

The real pipeline runs over the calibration prompts while plain forward hooks record, per
denoising step, the amax each quantizable layer sees. Each backbone (the UNet or DiT, or each expert
of a two-expert video model) has its own StepClock, which reads the timestep it is called with, so
the step is right however many calls a step takes (guidance batched or not, second-order
schedulers) and a backbone's statistics hold only the steps it serves. ModelOpt then inserts its
quantizers into each backbone, and a PercentileCalibrator on each activation quantizer turns the
recorded statistics into its amax: where Percentile Quant covers the quantizer
(quantize.percentile_layers), a statistic over the first ``int(served * percentile)`` of the steps
the backbone served (all n_steps for a single backbone) chosen by the collect method, else the
plain max:

===========  ===============================  ==============
method       per step, over calibration runs  over steps
===========  ===============================  ==============
global_min   min                              min
min-max      max                              min
min-mean     sum / steps served (or runs)     min
mean-max     max                              mean
max          max                              max (ModelOpt's plain max calibration)
===========  ===============================  ==============
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import QuantizeBlock
from ..cuda_graphs import CapturedGraph, clone_tensors
from ..errors import UserError
from ..parallel import World, combine, shard, sum_over_ranks
from ..progress import Progress
from .quantizers import ATTENTION_ROLES
from .recipe import calibration_algorithm, is_enabled, percentile_covers, uses_smoothquant
from .shared_ranges import tie_fp8_ranges


class StepClock:
    """The denoising step of the current backbone call, read from the timestep it is called with.

    The step is kept as a device tensor, worked out on the device, so that knowing it never makes
    the host wait for the GPU inside the denoising loop; ``index()`` reads it when needed.
    """

    def __init__(self, step: int | torch.Tensor | None = None):
        self.step = step

    def observe(self, timestep, timesteps: torch.Tensor) -> None:
        """Timesteps run from noise to clean (descending). Second-order schedulers repeat them
        (t0, t1, t1, t2, ...): both evaluations at one noise level belong to one step, so the
        step counts the distinct timesteps before the one nearest to this call's. Nearest, since a
        DiT is handed t / 1000 in its own precision (bf16 keeps 3 digits), which is not exactly any
        timestep of the schedule once scaled back; the schedule follows the pipeline's sigmas and
        any shift, as the pipeline sets it at the start of each run."""
        t = torch.as_tensor(timestep, device=timesteps.device).flatten()[0].float()
        first_of_run = torch.ones_like(timesteps, dtype=torch.bool)
        first_of_run[1:] = timesteps[1:] != timesteps[:-1]
        nearest = (timesteps.float() - t).abs().argmin()
        self.step = first_of_run.cumsum(0)[nearest] - 1

    def index(self) -> int:
        return int(self.step)


def attach_clock(pipe, family, backbone, clock: StepClock):
    """Keeps `clock` on the step of every call of `backbone`, a module of `pipe`; returns the hook
    handle."""

    def before_backbone(_module, args, kwargs):
        # The schedule is read at each call since the pipeline sets it at the start of each run.
        clock.observe(family.scheduler_timestep(args, kwargs), pipe.scheduler.timesteps)

    return backbone.register_forward_pre_hook(before_backbone, with_kwargs=True)


class StepStatistics:
    """The per-step statistic of one tensor's amax that the collect method needs, and no other.

    A single running value per step (sum, max or min) combines across calibration runs and
    across processes with one reduction. Sums are kept in float64: adding fp32 values there is
    exact in any order, so splitting the runs over processes cannot change the result. The amax
    is taken over the first `share` of the steps the backbone served (at least one); a mean divides
    each step's sum by the steps served (NeMo's n_steps, for a backbone that serves every step) or,
    with `per_run`, by the runs that step was seen in.
    """

    def __init__(self, collect_method: str, share: float = 1.0, per_run: bool = False):
        self.collect_method = collect_method
        self.share = share
        self.per_run = per_run
        self.values: dict[int, torch.Tensor] = {}
        self.counts: dict[int, int] = {}

    @property
    def reduction(self) -> str:
        return {"global_min": "min", "min-mean": "sum"}.get(self.collect_method, "max")

    def update(self, step: int, amax: torch.Tensor) -> None:
        update_all([self], step, [amax])

    @property
    def dtype(self) -> torch.dtype:
        return torch.float64 if self.reduction == "sum" else torch.float32

    def per_step(self, step: int) -> torch.Tensor:
        value = self.values[step]
        if self.reduction != "sum":
            return value
        return (value / (self.counts[step] if self.per_run else len(self.values))).float()

    def final_amax(self) -> torch.Tensor | None:
        """The amax over the first `share` of the steps observed; None when none was."""
        served = sorted(self.values)
        used = served[:max(1, int(len(served) * self.share))]
        if not used:
            return None
        stacked = torch.stack([self.per_step(step) for step in used])
        if self.collect_method == "mean-max":
            return stacked.mean(dim=0)
        if self.collect_method == "max":
            return stacked.max(dim=0).values
        return stacked.min(dim=0).values


def statistics_for(block: QuantizeBlock, percentile: bool) -> StepStatistics:
    """What a quantizer's range is taken from: Percentile Quant's statistic over the first
    percentile of the steps its backbone serves where it covers the quantizer, else the max over
    every step."""
    if not percentile:
        return StepStatistics("max")
    return StepStatistics(block.collect_method, block.percentile, per_run=block.mean_divisor == "runs")


_FOREACH_UPDATE = {"sum": torch._foreach_add_, "max": torch._foreach_maximum_,
                   "min": torch._foreach_minimum_}


@torch.no_grad()
def update_all(statistics: list[StepStatistics], step: int, amaxes: list[torch.Tensor]) -> None:
    """Adds one observation to each of `statistics` with one fused kernel launch per reduction,
    which keeps the per-call cost of thousands of recorded layers off the critical path."""
    grouped: dict[str, tuple[list, list]] = {}
    for stats, amax in zip(statistics, amaxes):
        stats.counts[step] = stats.counts.get(step, 0) + 1
        current = stats.values.get(step)
        if current is None:
            stats.values[step] = amax.detach().to(stats.dtype, copy=True)
        else:
            running, incoming = grouped.setdefault(stats.reduction, ([], []))
            running.append(current)
            incoming.append(amax.detach().to(stats.dtype))
    for reduction, (running, incoming) in grouped.items():
        _FOREACH_UPDATE[reduction](running, incoming)


def max_abs(x: torch.Tensor, keep_last_dim: bool) -> torch.Tensor:
    """amax in fp32, in one pass and no temporary copy: per last-dim channel, or of the whole tensor."""
    dim = tuple(range(x.dim() - 1)) if keep_last_dim else None
    return torch.linalg.vector_norm(x, ord=float("inf"), dim=dim, dtype=torch.float32)


# Reading the step of queued calls costs one host-device sync per this many backbone calls.
RESOLVE_EVERY_CALLS = 32


class ActivationRecorder:
    """Records, per denoising step, the amax of what the quantizable layers see.

    It runs on the plain backbone with plain forward hooks, before any quantizer is inserted: driving
    the calibration through ModelOpt's quantized modules instead costs their Python dispatch at
    every call, measured at 5-7x the generation time on the full-size SDXL UNet. Each hook only
    launches one reduction; the statistics are updated once per backbone call, for all layers at once.
    """

    def __init__(self, backbone, entries: list[dict], block: QuantizeBlock, clock: StepClock):
        self.clock = clock
        self.inputs: dict[str, StepStatistics] = {}
        self.input_channels: dict[str, StepStatistics] = {}
        # Per attention layer whose q/k/v ModelOpt quantizes (FP8 attention), the statistics of the
        # query, key and value where they enter scaled_dot_product_attention, as its quantizers see
        # them (after any q/k norm and rotary embedding).
        self.attention: dict[str, tuple[StepStatistics, ...]] = {}
        self._running_attention: list[str] = []
        self._pending_tensor: list[tuple[StepStatistics, torch.Tensor]] = []
        self._pending_channels: list[tuple[StepStatistics, StepStatistics, torch.Tensor]] = []
        self._calls: list[tuple] = []
        per_channel = uses_smoothquant(block.format, block.quant_level)
        self._handles = [backbone.register_forward_hook(lambda *_: self.flush())]
        for name, module in backbone.named_modules():
            if isinstance(module, (torch.nn.Conv2d, torch.nn.Linear)):
                if not is_enabled(entries, f"{name}.input_quantizer", module):
                    continue
                percentile = percentile_covers(block, module)
                self.inputs[name] = statistics_for(block, percentile)
                if per_channel and isinstance(module, torch.nn.Linear):
                    self.input_channels[name] = statistics_for(block, percentile)
                self._handles.append(module.register_forward_pre_hook(self._input_hook(name)))
            if hasattr(module, "to_q") and is_enabled(entries, f"{name}.{ATTENTION_ROLES[0]}_bmm_quantizer", module):
                self.attention[name] = tuple(statistics_for(block, percentile_covers(block, None))
                                             for _ in ATTENTION_ROLES)
                self._handles += [module.register_forward_pre_hook(self._entering(name)),
                                  module.register_forward_hook(self._leaving)]
        self._original_sdpa = None
        if self.attention:
            self._original_sdpa = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = self._recording_sdpa

    def _input_hook(self, name: str):
        per_tensor = self.inputs[name]
        per_channel = self.input_channels.get(name)

        def record(_module, args):
            if per_channel is None:
                self._pending_tensor.append((per_tensor, max_abs(args[0], keep_last_dim=False)))
            else:
                self._pending_channels.append((per_tensor, per_channel, max_abs(args[0], keep_last_dim=True)))

        return record

    def _entering(self, name: str):
        def enter(_module, _args):
            self._running_attention.append(name)

        return enter

    def _leaving(self, _module, _args, _output) -> None:
        self._running_attention.pop()

    def _recording_sdpa(self, *args, **kwargs):
        """scaled_dot_product_attention, noting its query, key and value amax inside the attention
        layers being recorded (diffusers passes them by position or by name)."""
        if self._running_attention and self._running_attention[-1] in self.attention:
            tensors = [kwargs[role] if role in kwargs else args[index]
                       for index, role in enumerate(("query", "key", "value"))]
            for statistics, tensor in zip(self.attention[self._running_attention[-1]], tensors):
                self._pending_tensor.append((statistics, max_abs(tensor, keep_last_dim=False)))
        return self._original_sdpa(*args, **kwargs)

    def flush(self) -> None:
        """Queues the amaxes of the backbone call that just ended under that call's step."""
        self._calls.append((self.clock.step, self._pending_tensor, self._pending_channels))
        self._pending_tensor, self._pending_channels = [], []
        if len(self._calls) >= RESOLVE_EVERY_CALLS:
            self.resolve()

    def resolve(self) -> None:
        """Folds the queued calls into the per-step statistics; reads their steps in one sync."""
        if not self._calls:
            return
        steps = torch.stack([torch.as_tensor(step) for step, _, _ in self._calls]).tolist()
        for step, (_, per_tensor, per_channel) in zip(steps, self._calls):
            if per_channel:
                tensor_stats, channel_stats, channels = zip(*per_channel)
                update_all(list(channel_stats), step, list(channels))
                channel_maxima = torch._foreach_norm(list(channels), ord=float("inf"))
                per_tensor = per_tensor + list(zip(tensor_stats, channel_maxima))
            if per_tensor:
                statistics, amaxes = zip(*per_tensor)
                update_all(list(statistics), step, list(amaxes))
        self._calls = []

    def take_pending(self) -> tuple[list, list]:
        """The amaxes queued since the last call ended, leaving none queued."""
        pending = (self._pending_tensor, self._pending_channels)
        self._pending_tensor, self._pending_channels = [], []
        return pending

    def queue_copies(self, template: tuple[list, list]) -> None:
        """Queues copies of a captured call's amax tensors (which the next replay overwrites), made
        with one fused kernel per list rather than one launch per layer."""
        per_tensor, per_channel = template
        tensor_copies = torch._foreach_add([amax for *_, amax in per_tensor], 0) if per_tensor else []
        channel_copies = torch._foreach_add([amax for *_, amax in per_channel], 0) if per_channel else []
        self._pending_tensor = [(*stats, amax) for (*stats, _), amax in zip(per_tensor, tensor_copies)]
        self._pending_channels = [(*stats, amax) for (*stats, _), amax in zip(per_channel, channel_copies)]

    def all_statistics(self) -> list[StepStatistics]:
        """Every statistic, in module order (the same in every process)."""
        return [*self.inputs.values(), *self.input_channels.values(),
                *(stats for roles in self.attention.values() for stats in roles)]

    def remove(self) -> None:
        self.resolve()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._original_sdpa is not None:
            F.scaled_dot_product_attention = self._original_sdpa
            self._original_sdpa = None

    def statistics_for(self, quantizer_name: str) -> tuple[StepStatistics | None, StepStatistics | None]:
        """(per-tensor, per-channel) statistics that feed the quantizer of this name."""
        owner, kind = quantizer_name.rsplit(".", 1)
        if kind == "input_quantizer":
            return self.inputs.get(owner), self.input_channels.get(owner)
        roles = [f"{role}_bmm_quantizer" for role in ATTENTION_ROLES]
        if kind in roles and owner in self.attention:
            return self.attention[owner][roles.index(kind)], None
        return None, None


class CapturedBackbone:
    """Runs the backbone, with the recorder's hooks, as one CUDA graph per input signature.

    Eager, a UNet at small batches is bound by the host launching its thousands of kernels, and
    the recording hooks add a launch per recorded layer; a replay costs the host a few launches.
    The first call of a signature runs eagerly (it also warms cuDNN and cuBLAS up), the second is
    captured and replayed. The amaxes a replay writes into the graph's own tensors are copied out
    and queued for the recorder as an eager call's would be, so the statistics are the same.
    Calls the graph cannot take (inputs off the GPU, Python floats that vary) run eagerly.
    """

    _STATIC_LEAVES = (type(None), bool, int, str)

    def __init__(self, backbone, recorder: ActivationRecorder):
        self.backbone = backbone
        self.recorder = recorder
        self.eager = backbone.forward
        self.warmed: set = set()
        self.graphs: dict = {}
        backbone.forward = self

    def remove(self) -> None:
        del self.backbone.forward
        self.graphs.clear()

    def __call__(self, *args, **kwargs):
        from torch.utils._pytree import tree_flatten

        leaves, spec = tree_flatten((args, kwargs))
        tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        if (any(not leaves[i].is_cuda for i in tensors)
                or any(not isinstance(leaf, self._STATIC_LEAVES) for i, leaf in enumerate(leaves) if i not in tensors)):
            return self.eager(*args, **kwargs)
        key = (str(spec), tuple((tuple(leaf.shape), leaf.dtype, leaf.device) if isinstance(leaf, torch.Tensor)
                                else leaf for leaf in leaves))
        if key not in self.graphs:
            if key not in self.warmed:
                self.warmed.add(key)
                return self.eager(*args, **kwargs)
            self.graphs[key] = self._capture(leaves, spec)
        captured, template = self.graphs[key]
        output = captured.replay({index: leaves[index] for index in tensors})
        self.recorder.queue_copies(template)
        return output

    def _capture(self, leaves: list, spec) -> tuple[CapturedGraph, tuple[list, list]]:
        """The graph of one call, with the amaxes its replays write (the recorder's template)."""
        from torch.utils._pytree import tree_unflatten

        static_leaves = clone_tensors(leaves)
        args, kwargs = tree_unflatten(static_leaves, spec)
        graph = torch.cuda.CUDAGraph()
        # The eager warm-up's cached blocks cannot serve the graph's private pool.
        torch.cuda.empty_cache()
        self.recorder.take_pending()
        with torch.cuda.graph(graph):
            output = self.eager(*args, **kwargs)
        inputs = {index: leaf for index, leaf in enumerate(static_leaves) if isinstance(leaf, torch.Tensor)}
        return CapturedGraph(graph, inputs, output), self.recorder.take_pending()


def _modelopt_calibrator_base():
    from modelopt.torch.quantization.calib import _Calibrator

    return _Calibrator


class PercentileCalibrator(_modelopt_calibrator_base()):
    """A ModelOpt calibrator whose amax is the Percentile Quant statistic over denoising steps.

    It holds the statistics the ActivationRecorder gathered: per tensor, and per channel for the
    Linear inputs SmoothQuant smooths (ModelOpt switches their axis to -1 while it calibrates).
    ``collect`` adds observations at the clock's step, for callers that drive it directly.
    """

    def __init__(self, num_bits=8, axis=None, unsigned=False, *, per_tensor: StepStatistics,
                 per_channel: StepStatistics | None, clock: StepClock):
        super().__init__(num_bits, axis, unsigned)
        self._per_tensor = per_tensor
        self._per_channel = per_channel
        self._clock = clock

    def _statistics(self) -> StepStatistics:
        if self._axis is None:
            return self._per_tensor
        if self._per_channel is None:
            raise RuntimeError("per-channel calibration asked for, but only per-tensor was recorded")
        return self._per_channel

    def collect(self, x):
        keep_last_dim = self._axis is not None
        self._statistics().update(self._clock.index(), max_abs(x, keep_last_dim=keep_last_dim))

    def reset(self):
        # The statistics are the calibration data itself; ModelOpt resets a calibrator after
        # loading its amax, and nothing must be dropped before every axis has been read.
        pass

    def compute_amax(self):
        return self._statistics().final_amax()


def _is_activation_quantizer(name: str) -> bool:
    return not name.endswith("weight_quantizer")


def install_percentile_calibrators(backbone, recorder: ActivationRecorder) -> int:
    """Puts a PercentileCalibrator on every enabled activation quantizer (the recorded statistics
    are its data, Percentile Quant's or plain max); returns how many."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    installed = 0
    for name, module in backbone.named_modules():
        if not (isinstance(module, TensorQuantizer) and module.is_enabled):
            continue
        if not _is_activation_quantizer(name) or module._constant_amax is not None:
            continue
        per_tensor, per_channel = recorder.statistics_for(name)
        if per_tensor is None:
            raise RuntimeError(f"no activation statistics were recorded for {name}")
        module._calibrator = PercentileCalibrator(
            module._num_bits, module._axis, module._unsigned, per_tensor=per_tensor,
            per_channel=per_channel, clock=recorder.clock,
        )
        installed += 1
    return installed


@dataclass
class CalibrationResult:
    seconds: float
    record_seconds: float  # the pipeline runs over the calibration prompts
    batches: int
    backbone_calls: int
    algorithm: dict
    # Quantizer statistics that are means over the calibration runs (Percentile Quant's min-mean).
    mean_statistics: int = 0
    # The denoising steps each backbone served, by attribute (every step for a single backbone).
    steps_served: dict | None = None

    def range_scales(self, block: QuantizeBlock) -> dict[str, float]:
        """What NeMo's divisor makes of each backbone's mean ranges: the runs over the steps it served
        (n_steps for a single backbone: 1.6 at NeMo's 32 prompts, one per call, 20 steps); 1 when the
        mean divides by the runs or none is a mean."""
        if not self.mean_statistics or block.mean_divisor != "n_steps":
            return {attribute: 1.0 for attribute in self.steps_served}
        return {attribute: self.batches / len(steps) for attribute, steps in self.steps_served.items()}


def calibration_batches(prompts: list[str], batch_size: int) -> list[list[str]]:
    return [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]


def run_calibration_prompts(pipe, family, batches: list[tuple[int, list[str]]], block: QuantizeBlock, seed: int,
                            progress: bool = True, call_kwargs: dict | None = None) -> int:
    """The real pipeline over (index, prompts) batches, latents only (no VAE); batch i is seeded
    seed + i. Returns the batches run."""
    # Where the pipeline computes, also when diffusers' CPU offload keeps its modules on the host.
    device = pipe._execution_device
    for index, batch in Progress(batches, "calibrating", "batches", show=progress):
        generator = torch.Generator(device=device).manual_seed(seed + index)
        pipe(prompt=batch, num_inference_steps=block.n_steps, guidance_scale=block.guidance_scale,
             height=block.height, width=block.width, generator=generator, output_type="latent",
             **family.pipeline_call_kwargs(pipe), **(call_kwargs or {}))
    return len(batches)


def quantize_backbones(pipe, family, prompts: list[str], block: QuantizeBlock, seed: int,
                       world: World = World(), cuda_graph: bool = True,
                       call_kwargs: dict | None = None) -> CalibrationResult:
    """Records activation statistics of every backbone of the pipeline (its UNet or transformer, or
    each expert of a two-expert model, each on the steps it serves) in one pass of the pipeline
    over the prompts, then inserts ModelOpt quantizers into each and sets their ranges (and
    SmoothQuant's scales) from those statistics, in place. Under torchrun each process records its
    share of the batches and the statistics are combined first. On a GPU each backbone runs as a
    CUDA graph unless `cuda_graph` is false. `call_kwargs`: what the pipeline call needs besides the
    block's settings (a video's frames)."""
    import modelopt.torch.quantization as mtq

    modules = {backbone.attribute: getattr(pipe, backbone.attribute) for backbone in family.backbones}
    entries = family.quant_cfg_entries(block.format, block.quant_level, block.high_precision_blocks)
    recorders, captured, hooks, backbone_calls = {}, [], [], []
    clocks = {attribute: StepClock() for attribute in modules}
    for attribute, module in modules.items():
        recorders[attribute] = ActivationRecorder(module, entries, block, clocks[attribute])
    idle = [attribute for attribute, recorder in recorders.items() if not recorder.inputs]
    if idle:
        for recorder in reversed(recorders.values()):
            recorder.remove()
        raise UserError(f"quantize.quant_level={block.quant_level:g}: every layer of this model's {' and '.join(idle)} "
                        "is one its family keeps in high precision at this level, so nothing would be quantized: "
                        "choose another level, or a model with more blocks")
    for attribute, module in modules.items():
        clock = clocks[attribute]
        if cuda_graph and module.device.type == "cuda":
            captured.append(CapturedBackbone(module, recorders[attribute]))
        hooks += [attach_clock(pipe, family, module, clock),
                  module.register_forward_pre_hook(lambda *_: backbone_calls.append(1))]
    start = time.perf_counter()
    try:
        batches = run_calibration_prompts(pipe, family, shard(calibration_batches(prompts, block.batch_size), world),
                                          block, seed, progress=world.is_main, call_kwargs=call_kwargs)
    except torch.OutOfMemoryError as error:
        raise UserError(
            f"the GPU ran out of memory while calibrating with quantize.batch_size="
            f"{block.batch_size}: lower quantize.batch_size"
        ) from error
    finally:
        for each in captured:
            each.remove()
        # Last in, first out: each recorder put its attention recording over the one before it.
        for recorder in reversed(recorders.values()):
            recorder.remove()
        for hook in hooks:
            hook.remove()

    statistics = [stats for recorder in recorders.values() for stats in recorder.all_statistics()]
    device = pipe._execution_device
    combine(statistics, world)
    batches = sum_over_ranks(batches, world, device)
    calls = sum_over_ranks(len(backbone_calls), world, device)
    record_seconds = time.perf_counter() - start
    algorithm = calibration_algorithm(block.format, block.quant_level, block.alpha)
    for attribute, module in modules.items():
        # Each backbone is quantized where its statistics are: on the pipeline's device, from where
        # diffusers' CPU offload (which keeps it on the host between calls) takes it back afterwards.
        home = next(module.parameters()).device
        module.to(device)
        mtq.quantize(module, {"quant_cfg": entries, "algorithm": None})
        install_percentile_calibrators(module, recorders[attribute])
        # The statistics are already recorded, so ModelOpt's calibration pass needs no forward.
        mtq.calibrate(module, algorithm, forward_loop=lambda _backbone: None)
        # The FP8 layers that the torch backend runs as one kernel share one range (sdquant.quantize.shared_ranges).
        tie_fp8_ranges(module, family.attention_projections)
        module.to(home)
    means = sum(stats.reduction == "sum" for stats in statistics)
    served = {attribute: sorted({step for stats in recorder.all_statistics() for step in stats.values})
              for attribute, recorder in recorders.items()}
    return CalibrationResult(time.perf_counter() - start, record_seconds, batches, calls, algorithm, means, served)


def activation_amax(backbone) -> dict[str, float]:
    """Per-tensor amax of every enabled activation quantizer, by quantizer name."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    found = {}
    for name, module in backbone.named_modules():
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
