"""A stand-in for NVIDIA's `tensorrt` Python module, which this machine cannot install (its wheels
download from NVIDIA's own index) and whose engines TensorRT for RTX cannot run on Hopper, so that
sdquant's TensorRT runtime can be driven unchanged on a GPU. It enters through the narrowest seam
there is: the module object in a `build.Flavour` (or `sys.modules`).

It keeps the part of TensorRT 10's documented contract that `sdquant.runtime.trt_stages` relies on, and
nothing of TensorRT's internals:
- an input shape must lie within the engine's optimization profile: `set_input_shape` returns
  False otherwise;
- `execute_async_v3(stream)` enqueues real CUDA kernels on that stream and returns at once; they
  read the inputs and write the outputs at the addresses given to `set_tensor_address`, and keep
  their activations in the memory given to `set_device_memory`, which they fill;
- the work takes time on the stream (a spin kernel), so a caller that does not order its streams
  reads or writes too early, and one that times another stream measures nothing;
- a context applies input-shape changes to its own device state at the next enqueue (the set-up
  TensorRT asks to keep out of a CUDA graph capture by enqueuing once before it), and its kernels
  read that state: a graph stays valid only while its context keeps the shapes of its capture;
- failure comes back as a return value: False from `set_input_shape`, `set_tensor_address` and
  `execute_async_v3`, None from `deserialize_cuda_engine` for a plan another TensorRT built;
- releases before 10.1 lack `set_device_memory(ptr, size)` and `device_memory_size_v2`.

A stand-in plan is JSON: each input's dtype and profile, each output's dtype and the input it is
computed from (output = 2 * input + 1), the device memory the engine needs and how long it works.
"""

from __future__ import annotations

import enum
import json
import math
import types
from pathlib import Path

import torch

FORMAT = "stand-in TensorRT plan"


class DataType(enum.Enum):
    FLOAT = torch.float32
    HALF = torch.float16
    INT32 = torch.int32
    INT64 = torch.int64


class TensorIOMode(enum.Enum):
    INPUT = 1
    OUTPUT = 2


class ExecutionContextAllocationStrategy(enum.Enum):
    STATIC = 0
    ON_PROFILE_CHANGE = 1
    USER_MANAGED = 2


class Logger:
    ERROR = 1
    WARNING = 2

    def __init__(self, severity: int = WARNING):
        self.severity = severity


_TYPESTR = {torch.float32: "<f4", torch.float16: "<f2", torch.int32: "<i4", torch.int64: "<i8", torch.uint8: "|u1"}


class _DeviceArray:
    """Raw device memory described by the CUDA array interface, which torch wraps without a copy."""

    def __init__(self, address: int, shape: tuple, dtype: torch.dtype):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": _TYPESTR[dtype],
                                         "data": (address, False), "strides": None, "version": 2}


def tensor_at(address: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A torch tensor over the memory at `address`, as an engine sees the addresses it is given."""
    device = torch.device("cuda", torch.cuda.current_device())
    tensor = torch.as_tensor(_DeviceArray(address, shape, dtype), device=device)
    assert tensor.data_ptr() == address, "torch copied instead of wrapping the address"
    return tensor


_CYCLES_PER_MS: list[float] = []


def spin(ms: float) -> None:
    """Keeps the current stream busy for about `ms` milliseconds (one kernel)."""
    if not _CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS.append(20_000_000 / start.elapsed_time(end))
    if ms > 0:
        torch.cuda._sleep(int(ms * _CYCLES_PER_MS[0]))


def write_plan(path: Path, inputs: dict, outputs: dict, *, built_by: tuple[str, str] = ("tensorrt", "10.13.0"),
               device_memory_bytes: int = 4 << 20, work_ms: float = 30.0, fail_enqueue: bool = False,
               capturable: bool = True) -> Path:
    """A stand-in plan. inputs: name -> {"dtype", "profile": [min, opt, max]}; outputs: name ->
    {"dtype", "from": input name}."""
    path.write_text(json.dumps({"format": FORMAT, "built_by": list(built_by), "inputs": inputs, "outputs": outputs,
                                "device_memory_bytes": device_memory_bytes, "work_ms": work_ms,
                                "fail_enqueue": fail_enqueue, "capturable": capturable}))
    return path


class _Engine:
    def __init__(self, spec: dict):
        self.spec = spec
        self.names = [*spec["inputs"], *spec["outputs"]]

    @property
    def num_io_tensors(self) -> int:
        return len(self.names)

    def get_tensor_name(self, index: int) -> str:
        return self.names[index]

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        return TensorIOMode.INPUT if name in self.spec["inputs"] else TensorIOMode.OUTPUT

    def get_tensor_dtype(self, name: str) -> DataType:
        return DataType[{**self.spec["inputs"], **self.spec["outputs"]}[name]["dtype"]]

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[tuple]:
        if profile_index != 0:
            raise IndexError("the stand-in engines have one optimization profile")
        return [tuple(dims) for dims in self.spec["inputs"][name]["profile"]]

    @property
    def device_memory_size(self) -> int:
        return self.spec["device_memory_bytes"]

    def create_execution_context(self, strategy=ExecutionContextAllocationStrategy.STATIC):
        return self.context_type(self)


class _Engine101(_Engine):
    @property
    def device_memory_size_v2(self) -> int:
        return self.spec["device_memory_bytes"]


class _Context:
    def __init__(self, engine: _Engine):
        self.engine = engine
        self._shapes: dict[str, tuple] = {}
        self._addresses: dict[str, int] = {}
        self._memory: tuple[int, int] | None = None
        # The context's own device state: the batch its kernels process, applied at enqueue.
        self._state = torch.zeros(1, dtype=torch.int64, device="cuda")
        self._applied: dict[str, tuple] | None = None
        self._views: dict[tuple, torch.Tensor] = {}

    def set_input_shape(self, name: str, shape) -> bool:
        profile = self.engine.spec["inputs"].get(name, {}).get("profile")
        shape = tuple(shape)
        if profile is None or len(shape) != len(profile[0]) or \
                not all(low <= dim <= high for dim, low, high in zip(shape, profile[0], profile[2])):
            return False
        self._shapes[name] = shape
        return True

    def set_tensor_address(self, name: str, address: int) -> bool:
        if name not in self.engine.names:
            return False
        self._addresses[name] = int(address)
        return True

    def get_tensor_shape(self, name: str) -> tuple:
        spec = self.engine.spec
        source = spec["outputs"][name]["from"] if name in spec["outputs"] else name
        return self._shapes.get(source, tuple(-1 for _ in spec["inputs"][source]["profile"][0]))

    def _set_memory(self, address: int, size: int) -> None:
        if size < self.engine.spec["device_memory_bytes"]:
            raise ValueError(f"device memory of {size} bytes is less than the engine's "
                             f"{self.engine.spec['device_memory_bytes']}")
        self._memory = (int(address), int(size))

    # TensorRT 10.0's way: the size is the engine's own.
    device_memory = property(None, lambda self, address: self._set_memory(address, self.engine.device_memory_size))

    def _view(self, address: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        key = (address, shape, dtype)
        if key not in self._views:
            self._views[key] = tensor_at(address, shape, dtype)
        return self._views[key]

    def execute_async_v3(self, stream_handle: int) -> bool:
        spec = self.engine.spec
        ready = (self._memory is not None and set(self._shapes) == set(spec["inputs"])
                 and set(self._addresses) == set(self.engine.names))
        if spec["fail_enqueue"] or not ready:
            return False
        # Handle 0 is the legacy default stream, which ExternalStream does not wrap (it makes a new one).
        stream = torch.cuda.ExternalStream(stream_handle) if stream_handle else torch.cuda.default_stream()
        with torch.cuda.stream(stream):
            if torch.cuda.is_current_stream_capturing() and not spec["capturable"]:
                return False
            if self._applied != self._shapes:
                self._state.fill_(next(iter(self._shapes.values()))[0])
                self._applied = dict(self._shapes)
            self._view(self._memory[0], (self._memory[1],), torch.uint8).fill_(0x5A)
            for name, output in spec["outputs"].items():
                self._run(name, output)
        return True

    def _run(self, name: str, output: dict) -> None:
        """output = 2 * input + 1 for the rows of the batch in the context's state; the input is read
        into the device memory as the work starts and the output written as it ends."""
        shape = self._shapes[output["from"]]
        assert 4 * math.prod(shape) <= self._memory[1], "the stand-in plan's device memory is too small"
        source_dtype = DataType[self.engine.spec["inputs"][output["from"]]["dtype"]].value
        activations = self._view(self._memory[0], shape, torch.float32)
        activations.copy_(self._view(self._addresses[output["from"]], shape, source_dtype))
        spin(self.engine.spec["work_ms"])
        rows = (torch.arange(shape[0], device=activations.device) < self._state).view(-1, *[1] * (len(shape) - 1))
        result = (activations * 2 + 1) * rows
        self._view(self._addresses[name], shape, DataType[output["dtype"]].value).copy_(result)


class _Context101(_Context):
    def set_device_memory(self, address: int, size: int) -> None:
        self._set_memory(address, size)


class _Runtime:
    def __init__(self, module, logger: Logger):
        self.module = module
        self.logger = logger

    def deserialize_cuda_engine(self, blob: bytes):
        try:
            spec = json.loads(blob)
        except ValueError:
            return None
        if spec.get("format") != FORMAT or spec.get("built_by") != [self.module.__name__, self.module.__version__]:
            print(f"[stand-in TRT] [E] the plan was built by {spec.get('built_by')}, not by this "
                  f"{self.module.__name__} {self.module.__version__}")
            return None
        spin(0)  # measures the spin kernel outside any graph capture
        engine = self.module.engine_type(spec)
        engine.context_type = self.module.context_type
        return engine


def module(version: str = "10.13.0", name: str = "tensorrt") -> types.ModuleType:
    """A stand-in `tensorrt` (or `tensorrt_rtx`) module of that version."""
    stand_in = types.ModuleType(name, f"stand-in for {name} {version}")
    stand_in.__version__ = version
    since_10_1 = name != "tensorrt" or tuple(int(p) for p in version.split(".")[:2]) >= (10, 1)
    stand_in.engine_type = _Engine101 if since_10_1 else _Engine
    stand_in.context_type = _Context101 if since_10_1 else _Context
    stand_in.Logger = Logger
    stand_in.DataType = DataType
    stand_in.TensorIOMode = TensorIOMode
    stand_in.ExecutionContextAllocationStrategy = ExecutionContextAllocationStrategy
    stand_in.Runtime = lambda logger: _Runtime(stand_in, logger)
    return stand_in
