"""Step-cache settings given on the command line, for our pipeline (a sampling.cache block) and
for a peer's diffusers pipeline (the same cache hook)."""

from __future__ import annotations

from sdquant.config import CacheBlock
from sdquant.families.flux import family as flux
from sdquant.runtime.cache_hooks import TAYLORSEER_METHODS, HookCache


# What the command lines take, checked before any work.
SETTING = (r"(taylorseer|taylorseer_blocks):\d+(:\d+(:\w+=\d+(,\w+=\d+)*)?)?"
           r"|first_block:[\d.]+(:\w+=[\d.]+(,\w+=[\d.]+)*)?"
           r"|first_block_steps:\w+=\d+(/\d+)*(,\w+=\d+(/\d+)*)*")
SAYS = ("taylorseer:<n>[:<warm-up passes>[:<backbone>=<n>,...]], the same for taylorseer_blocks, "
        "first_block:<threshold>[:<backbone>=<threshold>,...], or first_block_steps:<backbone>=<step>/<step>/...,... "
        "(First Block Cache on a fixed schedule: the steps each backbone runs in full)")


def per_backbone(pairs: str, kind) -> dict:
    """'<backbone>=<value>,...' as {backbone: value}."""
    return {name: kind(value) for name, value in (pair.split("=") for pair in pairs.split(","))}


def cache_block(setting: str) -> dict | None:
    """'taylorseer:<interval>[:<warm-up passes>[:<backbone>=<interval>,...]]', the same for
    'taylorseer_blocks' (warm-up 3 unless given; the named backbones at their own interval), or
    'first_block:<threshold>[:<backbone>=<threshold>,...]' or 'first_block_steps:<backbone>=<step>/<step>/...,...'
    as a sampling.cache block; '' as none."""
    if not setting:
        return None
    method, value, *rest = setting.split(":")
    if method == "first_block_steps":
        return {"method": "first_block",
                "backbone_full_steps": per_backbone(value, lambda steps: [int(step) for step in steps.split("/")])}
    if method not in TAYLORSEER_METHODS:
        block = {"method": method, "threshold": float(value)}
        if rest:
            block["backbone_thresholds"] = per_backbone(rest[0], float)
        return block
    block = {"method": method, "interval": int(value)}
    if rest:
        block["warmup"] = int(rest[0])
    if len(rest) > 1:
        block["backbone_intervals"] = per_backbone(rest[1], int)
    return block


def schedule_setting(schedule: dict[str, list[int]]) -> str:
    """A fixed schedule ({backbone: steps in full}) as the command lines' first_block_steps setting."""
    return "first_block_steps:" + ",".join(f"{name}={'/'.join(map(str, steps))}" for name, steps in schedule.items())


def hook_cache(setting: str, stacks: tuple[str, ...] = flux.BLOCK_STACKS) -> HookCache | None:
    """cache_block's setting as a cache hook on a transformer of these block lists (Flux's by
    default), for a peer that hooks diffusers' own pipeline."""
    block = cache_block(setting)
    return None if block is None else HookCache.of_block(CacheBlock(**block), stacks)
