"""A call captured as a CUDA graph and replayed on new inputs: what the TensorRT stage, the torch
backend's graph replay and calibration's captured UNet share. Each captures once per input
signature, in its own way (warm-up, failure, what else the call records); replaying is the same."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def signature(inputs: dict[str, torch.Tensor]) -> tuple:
    """What a captured graph is specific to: each input's name, shape and dtype."""
    return tuple((name, tuple(tensor.shape), tensor.dtype) for name, tensor in sorted(inputs.items()))


def clone_tensors(tree):
    """`tree` (tensors in any nesting) with every tensor copied."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf, tree)


@dataclass
class CapturedGraph:
    """One captured call: the graph, the input tensors it reads and the outputs it writes."""

    graph: torch.cuda.CUDAGraph
    inputs: dict
    outputs: object
    # What must live as long as the graph, such as the TensorRT context it was captured on.
    keeps: object = None

    def replay(self, inputs: dict):
        """Copies `inputs` into the graph's own, replays it and returns copies of its outputs: the
        next replay overwrites them."""
        for key, tensor in inputs.items():
            self.inputs[key].copy_(tensor)
        self.graph.replay()
        return clone_tensors(self.outputs)
