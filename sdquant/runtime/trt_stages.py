"""The TensorRT stage (GPU only): each engine as a stage (sdquant.runtime.stages' interface) on the
caller's CUDA stream, one device-memory block shared by all engines, optional CUDA graph replay
per input shape, and the check of a run against the engines' profiles before any work.

Follows TensorRT's tensor API as of 10.1 (``set_device_memory(ptr, size)``,
``device_memory_size_v2``), which TensorRT for RTX shares; every TensorRT call that reports
failure by its return value is checked. This is the part of the toolkit that needs a GPU TensorRT
can run on; it is kept to this module.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ..export.engines import Flavour, deserialize
from ..cuda_graphs import CapturedGraph, signature
from ..errors import UserError
from ..graphs.networks import BATCH, CONTEXT, TOKENS, Network

_TORCH_DTYPES = {"FLOAT": torch.float32, "HALF": torch.float16, "INT32": torch.int32, "INT64": torch.int64,
                 "BF16": torch.bfloat16, "BOOL": torch.bool, "INT8": torch.int8, "UINT8": torch.uint8}


def profile_error(engine: str, tensor: str, shape: tuple, profile: tuple, network: Network | None = None) -> str:
    """One line for a shape an engine's optimization profile does not admit, with what to rebuild;
    `network`, where known, tells a prompt that needs more CLIP windows from another image size."""
    low, _, high = profile
    context_axis = network is not None and network.dynamic_axes.get(tensor, {}).get(1) == CONTEXT
    if not low[0] <= shape[0] <= high[0]:
        fix = ("rebuild the engines with export_trt.py for this batch (infer.batch_size, trt.min_batch_size and "
               "trt.max_batch_size, in images; trt.static_batch=false for a range) or change sampling.batch_size "
               "or sampling.num_images_per_prompt")
    elif context_axis and not low[1] <= shape[1] <= high[1]:
        fix = (f"its prompts need {shape[1] // TOKENS} CLIP windows (sampling.long_prompts=chunk): rebuild the "
               f"engines with export_trt.py trt.max_prompt_chunks={shape[1] // TOKENS}, or shorten the prompts")
    else:
        fix = ("rebuild the engines with export_trt.py infer.width/infer.height (and a video's infer.num_frames) set "
               "to this run's, or run at the size they were built for")
    return (f"{engine} engine, input {tensor}: this run needs shape {tuple(shape)}, but its profile admits "
            f"{tuple(low)} to {tuple(high)}: {fix}")


def check_within_profiles(profiles: dict[str, dict[str, tuple]], batches: dict[str, int],
                          axis_sizes: dict[str, int], networks: dict[str, Network]) -> None:
    """Refuses, before any image work, a run whose batch, image size or prompt length an engine
    cannot take.

    `profiles`: per stage, each input's (min, opt, max) shape; `batches`: samples per call of each
    stage (the pipeline's stage_batches); `axis_sizes`: every other dynamic axis's size in this run
    (the pipeline's axis_sizes); `networks`: each stage's network, which says which axis is which.
    """
    for stage, batch in batches.items():
        sizes = {**axis_sizes, BATCH: batch}
        for tensor, profile in profiles[stage].items():
            # Each dynamic axis as this run sizes it (as the build sized it), the rest as the profile has them.
            shape = networks[stage].sized(tensor, profile[1], sizes)
            low, _, high = profile
            if not all(lo <= dim <= hi for dim, lo, hi in zip(shape, low, high)):
                raise UserError(profile_error(stage, tensor, shape, profile, networks[stage]))


class TrtStage:
    """One engine as a stage: named torch CUDA tensors in, named torch CUDA tensors out.

    It runs on the caller's current stream, so it follows the work that made its inputs, precedes
    the work that reads its outputs, and CUDA events recorded around a call time the engine.
    """

    def __init__(self, flavour: Flavour, runtime, plan: Path, cuda_graph: bool):
        self.trt = flavour.module
        self.name = plan.stem
        # TensorRT's documentation asks for the runtime to outlive the engines it deserialized.
        self.runtime = runtime
        self.engine = deserialize(flavour, runtime, plan)
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == self.trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]
        self.cuda_graph = cuda_graph
        self.device_memory: torch.Tensor | None = None
        self._context = None
        self._graphs: dict[tuple, CapturedGraph] = {}

    @property
    def device_memory_size(self) -> int:
        return self.engine.device_memory_size_v2

    def use_device_memory(self, block: torch.Tensor) -> None:
        """Runs the engine in `block`'s memory. The stage holds the block, so it stays allocated
        as long as the stage can run (the stages of a pipeline share one: they run in turn)."""
        self.device_memory = block
        self._context = self._new_context()

    def profiles(self) -> dict[str, tuple]:
        """Each input's (min, opt, max) shape in the engine's optimization profile."""
        return {name: tuple(tuple(dims) for dims in self.engine.get_tensor_profile_shape(name, 0))
                for name in self.inputs}

    def _new_context(self):
        context = self.engine.create_execution_context(self.trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        if context is None:
            raise UserError(f"{self.name} engine: TensorRT could not create an execution context: see its "
                            "messages above")
        context.set_device_memory(self.device_memory.data_ptr(), self.device_memory.numel())
        return context

    def _dtype(self, name: str) -> torch.dtype:
        return _TORCH_DTYPES[str(self.engine.get_tensor_dtype(name)).split(".")[-1]]

    def _prepared(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every input on the GPU in the engine's dtype and contiguous (a copy only where needed)."""
        device = self.device_memory.device
        return {name: inputs[name].to(device=device, dtype=self._dtype(name)).contiguous() for name in self.inputs}

    def _bind(self, context, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Sets every input's shape and address on `context` and allocates the outputs there."""
        for name, tensor in inputs.items():
            if not context.set_input_shape(name, tuple(tensor.shape)):
                raise UserError(profile_error(self.name, name, tuple(tensor.shape), self.profiles()[name]))
            self._set_address(context, name, tensor)
        outputs = {name: torch.empty(tuple(context.get_tensor_shape(name)), dtype=self._dtype(name),
                                     device=self.device_memory.device) for name in self.outputs}
        for name, tensor in outputs.items():
            self._set_address(context, name, tensor)
        return outputs

    def _set_address(self, context, name: str, tensor: torch.Tensor) -> None:
        if not context.set_tensor_address(name, tensor.data_ptr()):
            raise UserError(f"{self.name} engine: TensorRT refused the address of {name} "
                            f"(shape {tuple(tensor.shape)}): see its messages above")

    def _execute(self, context, inputs: dict[str, torch.Tensor]) -> None:
        if not context.execute_async_v3(torch.cuda.current_stream(self.device_memory.device).cuda_stream):
            shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in inputs.items())
            raise UserError(f"{self.name} engine: TensorRT could not run it on {shapes}: see its messages above")

    def __call__(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        if self._context is None:
            raise RuntimeError(f"{self.name}: call use_device_memory (trt_stages does) before running it")
        inputs = self._prepared(inputs)
        captured = self._graph_for(inputs) if self.cuda_graph else None
        if captured is None:
            outputs = self._bind(self._context, inputs)
            self._execute(self._context, inputs)
            return outputs
        return captured.replay(inputs)

    def _graph_for(self, inputs: dict[str, torch.Tensor]) -> CapturedGraph | None:
        """The CUDA graph for these input shapes, captured on first use; None once capture failed."""
        key = signature(inputs)
        if key not in self._graphs:
            captured = self._capture(inputs)
            if captured is None:
                return None
            self._graphs[key] = captured
        return self._graphs[key]

    def _capture(self, inputs: dict[str, torch.Tensor]) -> CapturedGraph | None:
        """Captures one call on a context of its own: a graph replays the addresses and shapes it was
        captured with, so no other shape may ever be set on that context. It runs once uncaptured
        first, as TensorRT asks, so that its set-up for the new shapes stays out of the graph."""
        context = self._new_context()
        static_inputs = {name: tensor.clone() for name, tensor in inputs.items()}
        static_outputs = self._bind(context, static_inputs)
        self._execute(context, static_inputs)
        graph = torch.cuda.CUDAGraph()
        reason = "its enqueue reported failure"
        try:
            with torch.cuda.graph(graph):
                enqueued = context.execute_async_v3(torch.cuda.current_stream().cuda_stream)
        except RuntimeError as error:
            enqueued, reason = False, str(error)
        if not enqueued:
            warnings.warn(f"{self.name}: the engine cannot be captured in a CUDA graph ({reason}); "
                          "running it without graphs")
            self.cuda_graph = False
            return None
        return CapturedGraph(graph, static_inputs, static_outputs, keeps=context)


def trt_stages(flavour: Flavour | dict[str, Flavour], plans: dict[str, Path],
               cuda_graph_stages: tuple[str, ...]) -> dict[str, TrtStage]:
    """Stages for every plan, each loaded by its TensorRT (`flavour`: one for all plans, or one per
    plan name, build.engine_flavour's), sharing one device-memory block."""
    flavours = flavour if isinstance(flavour, dict) else dict.fromkeys(plans, flavour)
    for each in flavours.values():
        each.require("running engines")
    if not torch.cuda.is_available():
        raise UserError("backend=trt needs a CUDA GPU: use backend=onnxruntime or backend=torch here")
    runtimes = {}
    stages = {}
    for name, plan in plans.items():
        module = flavours[name].module
        if flavours[name].name not in runtimes:
            runtimes[flavours[name].name] = module.Runtime(module.Logger(module.Logger.WARNING))
        stages[name] = TrtStage(flavours[name], runtimes[flavours[name].name], plan, name in cuda_graph_stages)
    block = torch.empty(max(s.device_memory_size for s in stages.values()), dtype=torch.uint8, device="cuda")
    for stage in stages.values():
        stage.use_device_memory(block)
    return stages
