"""Step-cache settings given on the command line, for our pipeline (a sampling.cache block) and
for a peer's diffusers pipeline (the same cache hook)."""

from __future__ import annotations

from sdquant.families.flux import family as flux
from sdquant.runtime.cache_hooks import TAYLORSEER_METHODS, HookCache


def cache_block(setting: str) -> dict | None:
    """'taylorseer:<interval>[:<warm-up passes>]', 'taylorseer_blocks:<interval>[:<warm-up passes>]'
    (3 unless given) or 'first_block:<threshold>' as a sampling.cache block; '' as none."""
    if not setting:
        return None
    method, value, *warmup = setting.split(":")
    if method in TAYLORSEER_METHODS:
        return {"method": method, "interval": int(value), **({"warmup": int(warmup[0])} if warmup else {})}
    return {"method": method, "threshold": float(value)}


def hook_cache(setting: str, stacks: tuple[str, ...] = flux.BLOCK_STACKS) -> HookCache | None:
    """cache_block's setting as a cache hook on a transformer of these block lists (Flux's by
    default), for a peer that hooks diffusers' own pipeline."""
    block = cache_block(setting)
    return None if block is None else HookCache(block["method"], block.get("interval", 1),
                                                block.get("threshold", 0.0), stacks, block.get("warmup", 3))
