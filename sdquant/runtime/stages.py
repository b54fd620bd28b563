"""The stages: each network of the pipeline behind one interface. Called with named tensors, a
stage returns named tensors, with the names of the ONNX graphs (each family's networks, e.g.
SDXL's clip1: input_ids -> hidden_states; unet_xl: x, timesteps, context, y -> out; vae: latent
-> images). Here the ``onnxruntime`` stage (the ONNX files) and the ``torch`` stage (the diffusers
modules, wrapped as the export wraps them), and the timer of stage calls; the TensorRT engines'
stage is in sdquant.runtime.trt_stages, and each family builds its torch stages (ModelFamily.torch_stages).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from ..export.onnx_graphs import check_graph_file
from ..graphs.networks import Network
from ..parallel import batch_parts


class OnnxRuntimeStage:
    """Runs an exported ONNX file; tensors cross as numpy on the host."""

    def __init__(self, onnx_file: Path, providers: list[str], key: str, network: Network, given: Path | None = None):
        """`key` is the config key naming the file; `given` what it holds where the file was found
        from it (an engine's graph beside its plan)."""
        import onnxruntime as ort
        from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidGraph, InvalidProtobuf, NoSuchFile

        if not onnx_file.is_file():
            raise UserError(f"{key}: {onnx_file} does not exist: run export_trt.py first")
        check_graph_file(onnx_file, key, network, given)
        try:
            self.session = ort.InferenceSession(str(onnx_file), providers=providers)
        except (Fail, InvalidGraph, InvalidProtobuf, NoSuchFile) as error:
            reason = str(error).splitlines()[0][:200]
            # An FP8 export is written for TensorRT, in its own FP8 quantize ops.
            remedy = ("it is an FP8 graph, in TensorRT's own ops: build engines from it (backend=trt) or run the "
                      "quantize.py checkpoint with backend=torch" if "TRT_FP8" in reason
                      else "export it again with export_trt.py")
            raise UserError(f"{key}: ONNX Runtime cannot load {onnx_file} ({reason}): {remedy}") from None
        self.input_types = {i.name: i.type for i in self.session.get_inputs()}
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.named = f"{key}={given or onnx_file}"

    def profiles(self) -> dict[str, tuple]:
        """The inputs whose every dimension the graph fixes, each as a (min, opt, max) shape of that one
        shape, as an engine's profile reads (a graph traced at fixed sizes has only such inputs)."""
        shapes = {i.name: i.shape for i in self.session.get_inputs()}
        return {name: (tuple(shape),) * 3 for name, shape in shapes.items() if all(isinstance(d, int) for d in shape)}

    def __call__(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

        device = next(iter(inputs.values())).device
        feeds = {name: _to_numpy(inputs[name], self.input_types[name]) for name in self.input_types}
        try:
            outputs = self.session.run(self.output_names, feeds)
        except InvalidArgument as error:
            # A graph exported before it recorded its model and geometry is checked only here.
            raise UserError(f"{self.named}: ONNX Runtime cannot run it on this run's inputs "
                            f"({str(error).splitlines()[0][:200]}): give the graph exported from this model at this "
                            "run's size (export_trt.py)") from None
        return {name: torch.from_numpy(value).to(device) for name, value in zip(self.output_names, outputs)}


_ONNX_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int32)": np.int32,
               "tensor(int64)": np.int64}


def _to_numpy(tensor: torch.Tensor, onnx_type: str) -> np.ndarray:
    return tensor.detach().cpu().numpy().astype(_ONNX_TYPES[onnx_type], copy=False)


class TorchStage:
    """A diffusers module wrapped as its graph, called with the graph's input names."""

    def __init__(self, graph: torch.nn.Module, network: Network, dtype: torch.dtype):
        self.graph = graph
        self.network = network
        self.dtype = dtype

    @torch.no_grad()
    def __call__(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        kept = self.network.kept_precision
        args = [inputs[name].to(self.dtype) if inputs[name].is_floating_point() and name not in kept
                else inputs[name] for name in self.network.input_names]
        outputs = self.graph(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return dict(zip(self.network.output_names, outputs))


class InTurn:
    """A stage whose calls run `size` samples at a time (None: the whole batch), one call after the
    other, their outputs joined; `context(index)` is entered around each part's call. The torch
    backend runs a family's backbones so where a sample's tokens are many
    (ModelFamily.backbone_call_samples)."""

    def __init__(self, stage, size: int | None = None):
        self.stage = stage
        self.size = size

    @property
    def graph(self):
        return self.stage.graph

    @graph.setter
    def graph(self, graph):
        self.stage.graph = graph

    def context(self, index: int):
        return contextlib.nullcontext()

    def __call__(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        batch = next(iter(inputs.values())).shape[0]
        outputs = []
        for index, part in enumerate(batch_parts(inputs, -(-batch // self.size) if self.size else 1)):
            with self.context(index):
                outputs.append(self.stage(**part))
        if len(outputs) == 1:
            return outputs[0]
        return {name: torch.cat([output[name] for output in outputs]) for name in outputs[0]}


class StageTimer:
    """Time per stage call. On a GPU it records CUDA events around each stage and reads them
    once at the end of the run, so timing never makes the host wait inside the loop. The events
    go on the current stream, which is the one every stage runs on (TensorRT engines included)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._events: dict[str, list] = {}
        self.seconds: dict[str, list[float]] = {}

    def time(self, name: str, fn, **inputs):
        if self.device.type != "cuda":
            start = time.perf_counter()
            result = fn(**inputs)
            self.seconds.setdefault(name, []).append(time.perf_counter() - start)
            return result
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn(**inputs)
        end.record()
        self._events.setdefault(name, []).append((start, end))
        return result

    def finish(self) -> dict[str, list[float]]:
        """Per stage, the seconds of each call; waits for the device once."""
        if self._events:
            torch.cuda.synchronize(self.device)
            for name, pairs in self._events.items():
                self.seconds.setdefault(name, []).extend(s.elapsed_time(e) / 1000 for s, e in pairs)
            self._events = {}
        return self.seconds
