"""Step caches for diffusion transformers: diffusers' own cache hooks on the transformer (First
Block Cache, TaylorSeer), which the torch backend's transformer stage runs under, one generation at
a time."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import warnings
from dataclasses import dataclass

from ..errors import UserError
from .stages import InTurn

TAYLORSEER_METHODS = ("taylorseer", "taylorseer_blocks")


def stacked_blocks(transformer, stacks: tuple[str, ...]) -> list[str]:
    """The module names of the transformer's blocks, first to last; `stacks`: its block lists in
    the order its forward runs them (the family's: Flux's double-stream, then single-stream)."""
    return [f"{stack}.{index}" for stack in stacks for index in range(len(getattr(transformer, stack, ())))]


def attention_modules(transformer, stacks: tuple[str, ...]) -> list[str]:
    """The module names of every block's attention modules, first to last."""
    from diffusers.models.attention import AttentionModuleMixin

    return [f"{block}.{child}" for block in stacked_blocks(transformer, stacks)
            for child, module in transformer.get_submodule(block).named_children()
            if isinstance(module, AttentionModuleMixin)]


def attention_identifiers(transformer, stacks: tuple[str, ...]) -> dict[str, list[str]]:
    """TaylorSeer's module patterns for predicting every block's attention modules, named one by one:
    what diffusers' default patterns (`^blocks.*attn`, ...) name in Flux, whose blocks call theirs
    `attn`, but they miss Wan's `attn1` and `attn2`, which would leave every step computed."""
    return {"cache_identifiers": [re.escape(name) for name in attention_modules(transformer, stacks)]}


def whole_block_identifiers(transformer, stacks: tuple[str, ...]) -> dict[str, list[str]]:
    """TaylorSeer's module patterns for predicting whole blocks: the last block predicted, every
    other one skipped. A predicted block ignores its input, so only the last block's prediction
    reaches the output: this draws what predicting every block draws, without keeping and
    extrapolating Taylor factors for the blocks whose predictions nothing reads."""
    *earlier, last = stacked_blocks(transformer, stacks)
    return {"cache_identifiers": [re.escape(last)], "skip_predict_identifiers": [re.escape(name) for name in earlier]}


@dataclass(frozen=True)
class HookCache:
    """A diffusers cache hook and its settings."""

    method: str
    interval: int
    threshold: float
    # The transformer's block lists, in the order its forward runs them (the family's).
    block_stacks: tuple[str, ...]
    # TaylorSeer's full passes before its first prediction (config.CacheBlock.warmup).
    warmup: int = 3
    # (backbone attribute, interval) pairs, sorted: the backbones whose interval is not `interval`.
    backbone_intervals: tuple[tuple[str, int], ...] = ()
    # TaylorSeer's highest order (config.CacheBlock.order).
    order: int = 1
    # (backbone attribute, threshold) pairs, sorted: the backbones whose threshold is not `threshold`.
    backbone_thresholds: tuple[tuple[str, float], ...] = ()
    # (backbone attribute, steps) pairs, sorted: the backbones First Block Cache runs on a fixed
    # schedule, the steps of their own that run in full (config.CacheBlock.backbone_full_steps).
    backbone_full_steps: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # One backbone's schedule (for_backbone's), None where its threshold decides.
    full_steps: tuple[int, ...] | None = None
    # A hook on the module: no graph or engine holds it, and it decides on the host.
    exported = False

    @property
    def stages_key(self) -> tuple:
        """What its stages depend on: every setting, which the hook on the module holds."""
        return (self.method, self.interval, self.threshold, self.block_stacks, self.warmup, self.backbone_intervals,
                self.order, self.backbone_thresholds, self.backbone_full_steps, self.full_steps)

    @classmethod
    def of_block(cls, block, block_stacks: tuple[str, ...]) -> HookCache | None:
        """The hook a sampling.cache block (config.CacheBlock) asks for on transformers of these
        block lists; None for none."""
        if block.method == "none":
            return None
        return cls(block.method, block.interval, block.threshold, block_stacks, block.warmup,
                   tuple(sorted(block.backbone_intervals.items())), block.order,
                   tuple(sorted(block.backbone_thresholds.items())),
                   tuple(sorted((name, tuple(sorted(set(steps)))) for name, steps in block.backbone_full_steps.items())))

    def for_backbone(self, attribute: str) -> HookCache:
        """The hook one backbone runs under: its own interval, threshold or schedule where one is named
        for it."""
        return dataclasses.replace(self, interval=dict(self.backbone_intervals).get(attribute, self.interval),
                                   threshold=dict(self.backbone_thresholds).get(attribute, self.threshold),
                                   full_steps=dict(self.backbone_full_steps).get(attribute, self.full_steps),
                                   backbone_intervals=(), backbone_thresholds=(), backbone_full_steps=())

    def config(self, transformer):
        from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig

        if self.method == "first_block":
            return FirstBlockCacheConfig(threshold=self.threshold)
        # `taylorseer` predicts only the attention modules, as diffusers' TaylorSeer does at its
        # defaults, so every block's feed-forward GEMMs still run on a predicted step.
        identifiers = (whole_block_identifiers if self.method == "taylorseer_blocks" else attention_identifiers)
        return TaylorSeerCacheConfig(cache_interval=self.interval, disable_cache_before_step=self.warmup,
                                     max_order=self.order, **identifiers(transformer, self.block_stacks))

    def full_pass_probe(self, transformer):
        """A function that says whether the transformer's last call ran in full (First Block Cache:
        its blocks after the first; TaylorSeer: the modules it predicts), read from the hook's state
        in the cache context the call ran in, so that counting adds nothing to the compiled code."""
        if self.method == "first_block":
            # Whichever block diffusers made the leader: every block's hook shares its state.
            manager = first_block_leader(transformer).state_manager
            return lambda: manager.get_state().should_compute
        predicted = (stacked_blocks(transformer, self.block_stacks)[-1] if self.method == "taylorseer_blocks"
                     else attention_modules(transformer, self.block_stacks)[0])
        manager = _hook(transformer.get_submodule(predicted), "taylorseer_cache").state_manager

        def computed() -> bool:
            state = manager.get_state()
            return state.last_update_step == state.current_step

        return computed

    def check(self, backbone_config, key: str) -> None:
        if self.method == "first_block" and self.threshold < 0:
            raise UserError(f"{key}.threshold={self.threshold}: give 0 (never skip) or more")
        for attribute, threshold in self.backbone_thresholds:
            if threshold < 0:
                raise UserError(f"{key}.backbone_thresholds.{attribute}={threshold}: give 0 (never skip) or more")
        for attribute, steps in self.backbone_full_steps:
            if not steps or steps[0] != 0:
                raise UserError(f"{key}.backbone_full_steps.{attribute}={list(steps)}: give the steps that run in "
                                "full, 0 among them (a first step has no earlier pass to reuse)")
            if attribute in dict(self.backbone_thresholds):
                raise UserError(f"{key}.backbone_thresholds.{attribute}: {attribute} runs on its backbone_full_steps "
                                "schedule, which no threshold decides: name it in one of the two")
        if self.method in TAYLORSEER_METHODS and self.interval < 1:
            raise UserError(f"{key}.interval={self.interval}: give a full pass every 1 or more steps")
        for attribute, interval in self.backbone_intervals:
            if interval < 1:
                raise UserError(f"{key}.backbone_intervals.{attribute}={interval}: give a full pass every 1 or "
                                "more steps")
        if self.method in TAYLORSEER_METHODS and self.order < 1:
            raise UserError(f"{key}.order={self.order}: give 1 (a line through the last two full passes) or more")
        if self.method in TAYLORSEER_METHODS and self.warmup < 1:
            raise UserError(f"{key}.warmup={self.warmup}: give 1 or more full passes before TaylorSeer predicts "
                            "(it predicts from what the full passes computed)")

    def describe(self) -> str:
        if self.method == "first_block":
            if self.full_steps is not None:
                return f"First Block Cache, in full at steps {', '.join(map(str, self.full_steps))}"
            own = "".join(f", {attribute} {threshold}" for attribute, threshold in self.backbone_thresholds)
            if not self.backbone_full_steps:
                return f"First Block Cache, threshold {self.threshold}{own}"
            # The block does not know its backbones: the threshold is said to hold where no schedule
            # is named, which is none where every backbone has one.
            fixed = ", ".join(f"{attribute} in full at steps {', '.join(map(str, steps))}"
                              for attribute, steps in self.backbone_full_steps)
            return f"First Block Cache, {fixed}; threshold {self.threshold}{own} where no schedule is named"
        scope = " over whole blocks" if self.method == "taylorseer_blocks" else ""
        own = "".join(f", {attribute} every {interval}" for attribute, interval in self.backbone_intervals)
        order = f", order {self.order}" if self.order != 1 else ""
        return (f"TaylorSeer{scope}, a full pass every {self.interval} steps{own} after the first {self.warmup}"
                f"{order}")


def _hook(module, name: str):
    """The diffusers hook of that name on the module, else None."""
    registry = getattr(module, "_diffusers_hook", None)
    return registry.get_hook(name) if registry is not None else None


def first_block_leader(transformer):
    """The hook of the block diffusers' First Block Cache made its leader (the first it hooked)."""
    return next(hook for module in transformer.modules() if (hook := _hook(module, "fbc_leader_block_hook")))


def allow_recompiles(transformer) -> None:
    """Lets torch.compile compile every block of a transformer under a cache hook. A hook decides
    on the host, which breaks the graph, and the code after the break is compiled anew for each
    state its guards tell apart: the block where they hold it (the full-size Flux transformer's
    attention hooks: past dynamo's limit of 8, the later 49 of its 57 blocks ran eager), and the
    hook's step counter where the compile specializes on it (diffusers' TaylorSeer update traced,
    as a peer runs it; ours runs it eagerly, update_taylorseer_eagerly)."""
    import torch._dynamo

    hooked = sum(1 for module in transformer.modules() if hasattr(module, "_diffusers_hook"))
    # Twice: a block's computed and predicted (or skipped) paths resume apart.
    needed = 2 * hooked + 8
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, needed)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * needed)


def update_taylorseer_eagerly(transformer) -> None:
    """Has the transformer's TaylorSeer hooks update their Taylor factors outside torch.compile's
    graphs. Traced, the update reads the hook's step counters as Python ints and the compile
    specializes on them: the code after the hook's decision compiled anew at each full pass of a
    generation, so a warm pipeline compiled again for a call of more steps. Eager, what is compiled
    depends only on whether a step computes; the update itself is a few element-wise operations on
    the predicted modules' outputs (under taylorseer_blocks, the last block's alone)."""
    from diffusers.hooks.taylorseer_cache import TaylorSeerCacheHook

    for module in transformer.modules():
        hook = getattr(module, "_diffusers_hook", None)
        hook = hook and hook.get_hook("taylorseer_cache")
        if isinstance(hook, TaylorSeerCacheHook):
            hook.state_manager._state_cls = eager_update_state()


@functools.cache
def eager_update_state() -> type:
    """diffusers' TaylorSeer state with its update run eagerly: one class, so that the compiled
    code's guards on the state's type hold across pipelines."""
    import torch
    from diffusers.hooks.taylorseer_cache import TaylorSeerState

    return type("EagerUpdateState", (TaylorSeerState,), {"update": torch.compiler.disable(TaylorSeerState.update)})


@functools.cache
def scheduled_leader() -> type:
    """diffusers' First Block Cache leader hook deciding by a schedule (its `run_in_full`, set
    before each call) instead of reading the first block's change back from the device: one class,
    so that the compiled code's guards on the hook's type hold across pipelines."""
    import torch
    from diffusers.hooks.first_block_cache import FBCHeadBlockHook

    def should_compute(self, hidden_states_residual) -> bool:
        # A context's first call has no tail residual to add yet, whatever the schedule says.
        return self.run_in_full or self.state_manager.get_state().head_block_residual is None

    return type("ScheduledLeaderHook", (FBCHeadBlockHook,),
                {"_should_compute_remaining_blocks": torch.compiler.disable(should_compute), "run_in_full": True})


@dataclass
class Passes:
    """A hooked backbone's calls (one per cache context entered) and how many ran in full, since
    its stage was built; `full_at[s]`: those of its step s (counted from its first call of a
    sample) that ran in full, from which a fixed schedule is read (backbone_full_steps)."""

    full: int = 0
    calls: int = 0
    full_at: list[int] = dataclasses.field(default_factory=list)


class HookedStage(InTurn):
    """The transformer's stage with the hook on its module: each call (each part of it, where the
    torch backend runs its batch in turn) in a cache context of its own, as diffusers' pipelines
    call the guidance halves, the hook's state cleared at each generation's first step. It counts
    the hooked calls, one per cache context entered (Wan's guidance halves two a step), and those
    that ran in full (`passes`)."""

    def __init__(self, stage, transformer, cache: HookCache, attribute: str):
        super().__init__(stage)
        self.transformer = transformer
        self.cache = cache
        self.attribute = attribute
        self.passes = Passes()
        # Per cache context, the calls since the hook's state was last cleared: a schedule's step.
        self.steps: dict[int, int] = {}
        self.told_of_steps_past = False
        self.enable()

    def enable(self) -> None:
        """Puts the hook on the module (again, after the family's release_cache took it off)."""
        self.transformer.enable_cache(self.cache.config(self.transformer))
        update_taylorseer_eagerly(self.transformer)
        self.ran_in_full = self.cache.full_pass_probe(self.transformer)
        self.leader = None
        if self.cache.full_steps is not None:
            self.leader = first_block_leader(self.transformer)
            self.leader.__class__ = scheduled_leader()

    def allow_recompiles(self) -> None:
        allow_recompiles(self.transformer)

    def reset(self) -> None:
        self.tell_of_steps_past()
        self.transformer._reset_stateful_cache()
        self.steps.clear()

    def tell_of_steps_past(self) -> None:
        """Warns, once, where the schedule names steps past those the sample just drawn ran: how
        many steps an expert runs follows from the call's steps and its boundary, known only here."""
        if self.cache.full_steps is None or not self.steps or self.told_of_steps_past:
            return
        ran = max(self.steps.values())
        past = [step for step in self.cache.full_steps if step >= ran]
        if past:
            self.told_of_steps_past = True
            warnings.warn(f"sampling.cache.backbone_full_steps.{self.attribute}: steps {past} never ran, "
                          f"{self.attribute} ran {ran} steps a sample at these settings: name steps under {ran}",
                          stacklevel=2)

    @contextlib.contextmanager
    def context(self, index: int):
        step = self.steps.get(index, 0)
        self.steps[index] = step + 1
        if self.leader is not None:
            self.leader.run_in_full = step in self.cache.full_steps
        with self.transformer.cache_context(f"part{index}"):
            yield
            self.passes.calls += 1
            if self.ran_in_full():
                self.passes.full += 1
                self.passes.full_at.extend([0] * (step + 1 - len(self.passes.full_at)))
                self.passes.full_at[step] += 1
