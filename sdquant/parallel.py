"""Data-parallel calibration under torchrun.

Each rank runs its share of the calibration batches (batch i on rank i mod world size, still
seeded seed + i, so every batch sees the same latents as in a one-process run), then the per-step
statistics are combined with one all-reduce per reduction (sum for means, max or min for the
others) before any amax or SmoothQuant scale is computed. Sums are kept in float64, where adding
fp32 values is exact whatever the order, so the combined result equals a one-process run bit for
bit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .errors import UserError


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_parallel(self) -> bool:
        return self.size > 1


def current_world() -> World:
    """The process's place among torchrun's processes (rank 0 of 1 when not launched by it)."""
    return World(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                 int(os.environ.get("LOCAL_RANK", 0)))


def rank_device(device: torch.device, world: World) -> torch.device:
    """Each rank's own GPU (LOCAL_RANK) when the device names none."""
    if world.is_parallel and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", world.local_rank)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    return device


def start(world: World, device: torch.device) -> None:
    import torch.distributed as dist

    if world.is_parallel and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def stop(world: World) -> None:
    import torch.distributed as dist

    if world.is_parallel and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def shard(batches: list, world: World,
          what: str = "calibration batches (quantize.calib_size / quantize.batch_size)") -> list[tuple[int, object]]:
    """(global index, batch) pairs this rank runs."""
    if len(batches) < world.size:
        raise UserError(f"{len(batches)} {what} cannot be split over {world.size} processes: give more or use "
                        "fewer processes")
    return [(index, batch) for index, batch in enumerate(batches) if index % world.size == world.rank]


def share_of(world: World, jobs) -> World:
    """This process's part among `jobs.count` independent jobs (shard.index of them) of world.size
    torchrun processes each, as one world: part index * size + rank of count * size."""
    return World(jobs.index * world.size + world.rank, jobs.count * world.size, world.local_rank)


def gather(value, world: World) -> list:
    """Every rank's `value`, in rank order (just [value] outside torchrun)."""
    import torch.distributed as dist

    if not world.is_parallel:
        return [value]
    values = [None] * world.size
    dist.all_gather_object(values, value)
    return values


_REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def combine(statistics: list, world: World) -> None:
    """All-reduces every StepStatistics in place (values by its reduction, observation counts by
    sum). Every rank holds the same layers and steps, so flattening in one order lines them up."""
    import torch.distributed as dist

    entries = [(stats, step) for stats in statistics for step in sorted(stats.values)]
    if not world.is_parallel or not entries:
        return
    device = entries[0][0].values[entries[0][1]].device
    counts = torch.tensor([stats.counts[step] for stats, step in entries], dtype=torch.int64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    for (stats, step), count in zip(entries, counts.tolist()):
        stats.counts[step] = count
    for reduction, op in _REDUCE_OPS.items():
        group = [(stats, step) for stats, step in entries if stats.reduction == reduction]
        if not group:
            continue
        values = [stats.values[step] for stats, step in group]
        flat = torch.cat([value.flatten() for value in values])
        dist.all_reduce(flat, op=getattr(dist.ReduceOp, op))
        for value, combined in zip(values, flat.split([value.numel() for value in values])):
            value.copy_(combined.view_as(value))


def sum_over_ranks(value: int, world: World, device: torch.device) -> int:
    import torch.distributed as dist

    if not world.is_parallel:
        return value
    total = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return int(total.item())
