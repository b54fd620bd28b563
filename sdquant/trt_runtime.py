"""TensorRT engines at run time (GPU only): the TensorRT 10/11 tensor API, one device-memory block
shared by all engines, and optional CUDA graph replay of fixed-shape calls.

This is the part of the toolkit that needs a GPU TensorRT can run on; it is kept to this module.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from .build import Flavour
from .errors import UserError

_TORCH_DTYPES = {"FLOAT": torch.float32, "HALF": torch.float16, "INT32": torch.int32, "INT64": torch.int64,
                 "BF16": torch.bfloat16, "BOOL": torch.bool, "INT8": torch.int8}


def deserialize(flavour: Flavour, runtime, plan: Path):
    if not plan.is_file():
        raise UserError(f"engine {plan} does not exist or cannot be read: build it with export_trt.py")
    blob = plan.read_bytes()
    engine = runtime.deserialize_cuda_engine(blob)
    if engine is None:
        raise UserError(
            f"engine {plan} cannot be loaded by {flavour.name} {flavour.version} on "
            f"{torch.cuda.get_device_name()}: it was built by another TensorRT version or for another "
            "GPU; rebuild it with export_trt.py force=true"
        )
    return engine


class TrtStage:
    """One engine as a stage: named torch CUDA tensors in, named torch CUDA tensors out."""

    def __init__(self, flavour: Flavour, runtime, plan: Path, stream: torch.cuda.Stream, cuda_graph: bool):
        trt = flavour.module
        self.name = plan.stem
        self.engine = deserialize(flavour, runtime, plan)
        self.context = self.engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]
        self.stream = stream
        self.cuda_graph = cuda_graph
        self._graphs: dict[tuple, tuple] = {}

    @property
    def device_memory_size(self) -> int:
        return self.engine.device_memory_size_v2

    def use_device_memory(self, block: torch.Tensor) -> None:
        self.context.set_device_memory(block.data_ptr(), self.device_memory_size)

    def _dtype(self, name: str) -> torch.dtype:
        return _TORCH_DTYPES[str(self.engine.get_tensor_dtype(name)).split(".")[-1]]

    def _enqueue(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for name in self.inputs:
            tensor = inputs[name].to(self._dtype(name)).contiguous()
            inputs[name] = tensor
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        outputs = {}
        for name in self.outputs:
            outputs[name] = torch.empty(tuple(self.context.get_tensor_shape(name)), dtype=self._dtype(name),
                                        device="cuda")
            self.context.set_tensor_address(name, outputs[name].data_ptr())
        self.context.execute_async_v3(self.stream.cuda_stream)
        return outputs

    def __call__(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        with torch.cuda.stream(self.stream):
            if not self.cuda_graph:
                return self._enqueue(dict(inputs))
            return self._replay(inputs)

    def _replay(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Captures the call once per input shape, then replays it: no per-layer launch cost."""
        key = tuple((name, tuple(inputs[name].shape)) for name in self.inputs)
        if key not in self._graphs:
            static_inputs = {name: inputs[name].to(self._dtype(name)).clone() for name in self.inputs}
            self._enqueue(dict(static_inputs))  # TensorRT sets itself up outside the capture
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, stream=self.stream):
                    static_outputs = self._enqueue(static_inputs)
            except RuntimeError as error:
                warnings.warn(f"{self.name}: CUDA graph capture failed ({error}); running without it")
                self.cuda_graph = False
                return self._enqueue(dict(inputs))
            self._graphs[key] = (graph, static_inputs, static_outputs)
        graph, static_inputs, static_outputs = self._graphs[key]
        for name in self.inputs:
            static_inputs[name].copy_(inputs[name])
        graph.replay()
        return static_outputs


def trt_stages(flavour: Flavour, plans: dict[str, Path], cuda_graph_stages: tuple[str, ...]) -> dict:
    """Stages for every plan, sharing one device-memory block: they run one after another."""
    if not torch.cuda.is_available():
        raise UserError("backend=trt needs a CUDA GPU: use backend=onnxruntime or backend=torch here")
    runtime = flavour.module.Runtime(flavour.module.Logger(flavour.module.Logger.WARNING))
    stream = torch.cuda.Stream()
    stages = {name: TrtStage(flavour, runtime, plan, stream, name in cuda_graph_stages)
              for name, plan in plans.items()}
    block = torch.empty(max(s.device_memory_size for s in stages.values()), dtype=torch.uint8, device="cuda")
    for stage in stages.values():
        stage.use_device_memory(block)
    return stages
