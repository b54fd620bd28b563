"""Step caches for diffusion transformers: diffusers' own cache hooks on the transformer (First
Block Cache, TaylorSeer), which the torch backend's transformer stage runs under, one generation at
a time."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UserError


@dataclass(frozen=True)
class HookCache:
    """A diffusers cache hook and its settings."""

    method: str
    interval: int
    threshold: float
    # A hook on the module: no graph or engine holds it, and it decides on the host.
    exported = False

    def config(self):
        from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig

        if self.method == "first_block":
            return FirstBlockCacheConfig(threshold=self.threshold)
        return TaylorSeerCacheConfig(cache_interval=self.interval)

    def check(self, backbone_config, key: str) -> None:
        if self.method == "first_block" and self.threshold < 0:
            raise UserError(f"{key}.threshold={self.threshold}: give 0 (never skip) or more")
        if self.method == "taylorseer" and self.interval < 1:
            raise UserError(f"{key}.interval={self.interval}: give a full pass every 1 or more steps")

    def describe(self) -> str:
        if self.method == "first_block":
            return f"First Block Cache, threshold {self.threshold}"
        return f"TaylorSeer, a full pass every {self.interval} steps"


class HookedStage:
    """The transformer's stage with the hook on its module: each call in the hook's cache context
    (as diffusers' pipelines call it), the hook's state cleared at each generation's first step."""

    def __init__(self, stage, transformer, cache: HookCache):
        transformer.enable_cache(cache.config())
        self.stage = stage
        self.transformer = transformer

    def allow_recompiles(self) -> None:
        """Lets torch.compile compile every hooked block. A hook decides on the host, which breaks
        the graph, and the code after the break is compiled once per block (its guards hold the
        block itself): past dynamo's limit (8) the remaining blocks of the full-size Flux
        transformer (57) would silently run eager."""
        import torch._dynamo

        hooked = sum(1 for module in self.transformer.modules() if hasattr(module, "_diffusers_hook"))
        # Twice: a block's computed and predicted (or skipped) paths resume apart.
        needed = 2 * hooked + 8
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, needed)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * needed)

    @property
    def graph(self):
        return self.stage.graph

    @graph.setter
    def graph(self, graph):
        self.stage.graph = graph

    def reset(self) -> None:
        self.transformer._reset_stateful_cache()

    def __call__(self, **inputs):
        with self.transformer.cache_context("cond"):
            return self.stage(**inputs)
