"""Refit stage: new weights (another LoRA adapter or scale) written into built engines.

Engines built with ``trt.refittable=true`` mark (build.make_refittable) every floating-point weight of their ONNX graph
refittable (TensorRT's REFIT_INDIVIDUAL): those are the graph's initializers, which the export
names after the traced module's state-dict keys and fills from its tensors. A refit therefore
takes the same module of a pipeline loaded with the new adapters fused in, and hands TensorRT's
Refitter each tensor under its initializer's name: no ONNX export and no build.

8-bit UNet engines are never refittable: their Q/DQ scales were calibrated on the adapters they
were made with, so other adapters need quantize.py again (recalibration) and a new engine.
Deserializing and refitting need the GPU the engine was built for; that part is `refit_engine`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..artifacts import atomic_path
from ..errors import UserError
from ..lora import describe
from . import engines

# The weights a refit can replace, by ONNX TensorProto element type and TensorRT DataType name.
ONNX_FLOAT_TYPES = {1: torch.float32, 10: torch.float16, 16: torch.bfloat16}
TRT_FLOAT_TYPES = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16}


def refittable_weights(onnx_file: Path) -> dict[str, tuple[torch.dtype, int]]:
    """Name -> (dtype, element count) of every floating-point initializer of `onnx_file`: what a
    refittable build marks, and what a refit must then supply. Reads no weight data."""
    import onnx

    graph = onnx.load(str(onnx_file), load_external_data=False).graph
    return {tensor.name: (ONNX_FLOAT_TYPES[tensor.data_type], int(np.prod(tensor.dims, dtype=np.int64)))
            for tensor in graph.initializer if tensor.data_type in ONNX_FLOAT_TYPES}


def needs_refit(record: dict, plan: Path, wanted: list[dict]) -> bool:
    """Whether the engine at `plan` (described by its engines.json `record`) needs a refit to hold
    the adapters `wanted`; refuses an engine that cannot take them, before anything is written."""
    held = record.get("loras", [])
    if held == wanted:
        return False
    # Engines built before the name was general record their checkpoint as quantized_unet.
    if record.get("quantized_backbone") or record.get("quantized_unet"):
        raise UserError(f"{plan} is an 8-bit backbone made with {describe(held)}: its Q/DQ scales were calibrated "
                        f"on those adapters, so {describe(wanted)} needs quantize.py with them "
                        "(recalibration) and a new engine; refit swaps adapters in fp16 engines only")
    if not record.get("refittable"):
        raise UserError(f"{plan} was built without trt.refittable=true: build it again with "
                        "trt.refittable=true to swap adapters without rebuilding")
    return True


def refit_sources(expected: dict[str, tuple[torch.dtype, int]],
                  tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The refit's source for every refittable weight, `expected` by name, dtype and element count:
    the module tensor of that name, in the engine's dtype, contiguous in host memory."""
    absent = [name for name in expected if name not in tensors]
    if absent:
        raise UserError(f"the engine has refittable weights the model does not name ({', '.join(absent[:3])}): "
                        "it was built from another model; build it again")
    sources = {}
    for name, (dtype, count) in expected.items():
        if tensors[name].numel() != count:
            raise UserError(f"weight {name} holds {count} values in the engine and {tensors[name].numel()} in "
                            "the model: the engine was built from another model; build it again")
        sources[name] = tensors[name].detach().to("cpu", dtype).contiguous()
    return sources


def refit_engine(flavour, plan: Path, tensors: dict[str, torch.Tensor]) -> int:
    """Writes `tensors` into the engine at `plan` with TensorRT's Refitter and saves it in place;
    returns how many weights were refitted. Needs the GPU the engine was built for."""
    trt = flavour.module
    logger = trt.Logger(trt.Logger.WARNING)
    engine = engines.deserialize(flavour, trt.Runtime(logger), plan)
    refitter = trt.Refitter(engine, logger)
    prototypes = {name: refitter.get_weights_prototype(name) for name in refitter.get_all_weights()}
    sources = refit_sources({name: (TRT_FLOAT_TYPES[str(p.dtype).split(".")[-1]], p.size)
                             for name, p in prototypes.items()}, tensors)
    for name, source in sources.items():  # held until the refit has read them
        weights = trt.Weights(prototypes[name].dtype, source.data_ptr(), source.numel())
        if not refitter.set_named_weights(name, weights, trt.TensorLocation.HOST):
            raise RuntimeError(f"TensorRT refused the weights {name} for {plan}")
    missing = refitter.get_missing_weights()
    if missing or not refitter.refit_cuda_engine():
        raise RuntimeError(f"TensorRT could not refit {plan} (weights still missing: {list(missing)[:3]})")
    with atomic_path(plan) as temp:
        temp.write_bytes(engine.serialize())
    return len(sources)
