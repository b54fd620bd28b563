"""diffusers' context parallelism on a CPU, for the tests. diffusers places each process on device
rank % torch.accelerator.device_count(), which is 0 where no GPU is; this says there is one, and
the gloo process group does the rest.

    python -m torch.distributed.run --nproc_per_node=2 tests/cpu_context_parallel.py <infer_trt.py's arguments>
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import torch
import torch.accelerator


def expert_over_processes(rank: int, size: int, port: int, checkpoint: str, inputs: dict, out: str) -> None:
    """One of `size` processes (torch.multiprocessing.spawn): tiny_wan's second expert from
    `checkpoint` with the FP8 kernels, its tokens split over the processes; the first saves the
    expert's output, the shape block 1 saw and how many FP8 processors were handed the group."""
    import torch.distributed as dist

    from sdquant import parallel
    from sdquant.families.wan import WAN
    from sdquant.runtime import torch_backend
    from conftest import restored_backbones

    torch.accelerator.device_count = lambda: 1
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    backbones = restored_backbones("tiny_wan", checkpoint)
    expert = backbones["transformer_2"].to(torch.float32)
    torch_backend.convert_quantized(expert, WAN, "quantized_backbone", "fp8", "auto", 4.0)
    place = parallel.place_of(parallel.SampleSplit(1, size), parallel.World(rank, size), torch.device("cpu"))
    parallel.split_by_sequence([expert], place, size)
    seen = []
    expert.blocks[1].register_forward_hook(lambda module, args, output: seen.append(tuple(output.shape)))
    with torch.no_grad():
        output = expert(**inputs, return_dict=False)[0]
    if rank == 0:
        given = sum(getattr(layer.processor, "sequence_group", None) is not None
                    for layer in expert.modules() if hasattr(layer, "processor"))
        torch.save({"output": output, "block_output": seen[0], "split_processors": given}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.accelerator.device_count = lambda: 1
    script = Path(__file__).resolve().parent.parent / "infer_trt.py"
    sys.argv = [str(script), *sys.argv[1:]]
    runpy.run_path(str(script), run_name="__main__")
