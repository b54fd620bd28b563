"""Processes under torchrun: data-parallel calibration, and the processes that share one sample.

Each rank runs its share of the calibration batches (batch i on rank i mod world size, still
seeded seed + i, so every batch sees the same latents as in a one-process run), then the per-step
statistics are combined with one all-reduce per reduction (sum for means, max or min for the
others) before any amax or SmoothQuant scale is computed. Sums are kept in float64, where adding
fp32 values is exact whatever the order, so the combined result equals a one-process run bit for
bit.

Processes that share one sample (parallel.cfg, parallel.ulysses; a video is the case that needs
it) form a group: with cfg=2 each backbone call's guidance halves run on two processes and their
outputs are gathered; with ulysses=N diffusers' context parallelism splits each backbone call's
tokens over N processes, all-to-all around attention. Every process of a group draws the same
sample; the group's first process writes it. The groups share the prompt batches as ranks do.
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


@dataclass(frozen=True)
class SampleSplit:
    """parallel.cfg and parallel.ulysses: the processes of one sample are cfg x ulysses."""

    cfg: int = 1
    ulysses: int = 1

    @property
    def size(self) -> int:
        return self.cfg * self.ulysses

    def named(self) -> str:
        return f"parallel.cfg={self.cfg} parallel.ulysses={self.ulysses}"


@dataclass(frozen=True)
class SamplePlace:
    """A process's place in its sample's group: `replicas` is the world of groups (which share the
    prompt batches), `cfg_rank` the guidance half it runs, `writes` whether it writes the sample."""

    replicas: World
    writes: bool = True
    cfg_rank: int = 0
    cfg_group: object = None
    sequence_mesh: object = None


def check_split(split: SampleSplit, world: World, halves: bool, heads: int | None, tokens: int | None,
                model: str) -> None:
    """Refuses a split the process count, the guidance or the model cannot take, before any work."""
    if world.size % split.size:
        raise UserError(f"{split.named()} makes groups of {split.size} processes, which {world.size} process(es) do "
                        f"not divide: start a multiple of {split.size} (torchrun --nproc_per_node)")
    if split.cfg > 1 and not halves:
        raise UserError(f"parallel.cfg={split.cfg} runs the guidance halves of each backbone call apart, and "
                        f"model={model}'s calls here hold none (sampling.guidance_scale is 1 or less, or the model "
                        "takes no classifier-free guidance): set parallel.cfg=1")
    if split.ulysses == 1:
        return
    if tokens is None:
        raise UserError(f"parallel.ulysses={split.ulysses}: model={model}'s backbones are not split by sequence here "
                        "(Wan2.2's are): set parallel.ulysses=1")
    if heads % split.ulysses or tokens % split.ulysses:
        raise UserError(f"parallel.ulysses={split.ulysses} must divide the backbone's {heads} attention heads and its "
                        f"{tokens} tokens a call at this size: choose a divisor of both")
    import torch.accelerator

    if torch.accelerator.device_count() == 0:
        raise UserError(f"parallel.ulysses={split.ulysses}: diffusers' context parallelism places each process on a "
                        "GPU, and none is visible")


def replicas_of(split: SampleSplit, world: World) -> World:
    """The world of groups, each `split.size` processes of consecutive ranks (as place_of's mesh
    orders them), which share the prompt batches as data-parallel ranks do."""
    return World(world.rank // split.size, world.size // split.size, world.local_rank)


def place_of(split: SampleSplit, world: World, device: torch.device) -> SamplePlace:
    """This process's group: processes rank // split.size together, the guidance half the middle
    index, the token share the last (a device mesh of groups x cfg x 1 x ulysses, the 1 being
    diffusers' ring attention, unused)."""
    if split.size == 1:
        return SamplePlace(world)
    from torch.distributed.device_mesh import init_device_mesh

    groups = world.size // split.size
    mesh = init_device_mesh(device.type, (groups, split.cfg, 1, split.ulysses),
                            mesh_dim_names=("group", "cfg", "ring", "ulysses"))
    _, cfg_rank, _, token_rank = mesh.get_coordinate()
    return SamplePlace(replicas_of(split, world), writes=cfg_rank == 0 and token_rank == 0,
                       cfg_rank=cfg_rank, cfg_group=mesh["cfg"].get_group() if split.cfg > 1 else None,
                       sequence_mesh=mesh["ring", "ulysses"] if split.ulysses > 1 else None)


def batch_parts(inputs: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """A call's inputs as `parts` calls, each a share of its batch in order: the batch of the first
    input (the latent), which every batched input shares; an input without it goes whole to each."""
    batch = next(iter(inputs.values())).shape[0]
    shares = {name: value.chunk(parts) if value.dim() and value.shape[0] == batch else (value,) * parts
              for name, value in inputs.items()}
    return [{name: share[index] for name, share in shares.items()} for index in range(parts)]


class GuidanceHalf:
    """A backbone stage that runs one guidance half of each call (its inputs' batch holds both
    halves, [unconditional..., conditional...]) and gathers the group's halves into the whole
    batch's outputs."""

    def __init__(self, stage, place: SamplePlace):
        self.stage = stage
        self.place = place

    def __getattr__(self, name: str):
        return getattr(self.stage, name)

    def __call__(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        import torch.distributed as dist

        # The batch is even, both halves, where the split is settled.
        half = batch_parts(inputs, 2)[self.place.cfg_rank]
        outputs = {}
        for name, value in self.stage(**half).items():
            value = value.contiguous()
            parts = [torch.empty_like(value) for _ in range(2)]
            dist.all_gather(parts, value, group=self.place.cfg_group)
            outputs[name] = torch.cat(parts)
        return outputs


def split_guidance(stages: dict, backbones: tuple[str, ...], place: SamplePlace) -> dict:
    """The backbone stages as GuidanceHalf stages where the group splits the guidance halves."""
    if place.cfg_group is None:
        return stages
    return {name: GuidanceHalf(stage, place) if name in backbones else stage for name, stage in stages.items()}


def split_by_sequence(modules, place: SamplePlace, ulysses: int) -> None:
    """diffusers' context parallelism on each backbone module: its tokens split over the group's
    `ulysses` processes at the first block, all-to-all around attention, gathered at the output."""
    if place.sequence_mesh is None:
        return
    from diffusers import ContextParallelConfig

    group = place.sequence_mesh["ulysses"].get_group()
    for module in modules:
        # The torch backend's processors take the text whole in cross-attention, as diffusers'
        # plan for Wan leaves it (since diffusers 0.42); a plan that splits it would need them to
        # gather it.
        if any("encoder_hidden_states" in entry for entry in module._cp_plan.values() if isinstance(entry, dict)):
            raise UserError(f"parallel.ulysses={ulysses}: this diffusers splits {type(module).__name__}'s text "
                            "tokens too, which the torch backend's attention processors do not take: use diffusers "
                            "0.42 or set parallel.ulysses=1")
        module.enable_parallelism(config=ContextParallelConfig(ulysses_degree=ulysses, mesh=place.sequence_mesh))
        # The torch backend's own processors (FP8 layers) split their attention themselves.
        for layer in module.modules():
            if hasattr(getattr(layer, "processor", None), "sequence_group"):
                layer.processor.sequence_group = group
