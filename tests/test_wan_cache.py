"""Step caching on Wan2.2's experts through diffusers' cache hooks (sampling.cache.method first_block,
taylorseer, taylorseer_blocks) on the tiny models: tiny_wan's two experts each under a hook of its
own, both started afresh with every video, and tiny_wan_ti2v's one transformer through the same code;
the counts of a late block's layer calls show what each hook skipped."""

from __future__ import annotations

import collections
import json
import warnings

import pytest
import torch

from sdquant.api import load as load_api
from sdquant.load import load_pipeline
from sdquant.runtime.stages import StageTimer
from sdquant.workflow.evaluate import run_evaluate
from sdquant.runs.infer import settle_infer
from sdquant.workflow.infer_trt import run_infer

from conftest import compose_config, flow_over, refused_in_one_line

CPU = torch.device("cpu")
# 12 UniPC steps at flow shift 3: tiny_wan's high-noise expert serves 4 (t >= 875), the other 8.
STEPS = 12
RUN = ["device=cpu", "backend=torch", "sampling.prompts=['a red fox runs through the snow']",
       f"sampling.steps={STEPS}", "sampling.guidance_scale=4.0"]
FIRST_BLOCK = ["sampling.cache.method=first_block"]


class Videos:
    """A model's flow over its torch stages under a sampling.cache, with each expert's calls of a late
    block's feed-forward (which runs unless the whole block is skipped or predicted) and of its
    self-attention's output projection (which runs unless the attention is predicted) counted."""

    def __init__(self, model: str, *cache: str):
        cfg = compose_config("sd_xl_trt_inference", [f"model={model}", *RUN, *cache])
        run = settle_infer(cfg)
        self.first, family = run.sampling.first, run.pipeline.family
        pipe = load_pipeline(cfg.model, CPU, torch.float32)
        self.calls = collections.Counter()
        for attribute, expert in family.backbone_modules(pipe).items():
            block = expert.blocks[-2]
            for counted, layer in (("feed-forward", block.ffn), ("attention", block.attn1.to_out[0])):
                layer.register_forward_hook(lambda *_, key=(attribute, counted): self.calls.update([key]))
        self.flow = flow_over(run, family.torch_stages(pipe, torch.float32, self.first.cache))

    def draw(self) -> torch.Tensor:
        """One video (1, F, 3, H, W) of the run's first prompt batch."""
        return self.flow(self.first, StageTimer(CPU), progress=False)

    def counted(self, layer: str) -> dict[str, int]:
        return {attribute: n for (attribute, counted), n in self.calls.items() if counted == layer}

    def passes(self, counted: str = "full") -> dict[str, int]:
        """Each expert's calls run in full (or, "calls", all its hooked calls) as its hooked stage
        counted them (Drawn.cache_passes)."""
        return {name: getattr(stage.passes, counted) for name, stage in self.flow.stages.items()
                if hasattr(stage, "passes")}


# Each expert's calls in a video of STEPS steps.
CALLS = {"tiny_wan": {"transformer": 4, "transformer_2": 8}, "tiny_wan_ti2v": {"transformer": 12}}


@pytest.mark.parametrize("model", CALLS)
def test_first_block_cache_at_threshold_0_draws_the_uncached_video_and_above_runs_the_blocks_once_an_expert(
        model_cache, model):
    plain = Videos(model).draw()
    never = Videos(model, *FIRST_BLOCK, "sampling.cache.threshold=0")
    assert torch.equal(never.draw(), plain)
    assert never.counted("feed-forward") == never.passes() == CALLS[model]
    # Past any relative change of the first block's output: each expert computes its blocks at its
    # first call of the video only (nothing to compare with yet), then reuses their residual.
    always = Videos(model, *FIRST_BLOCK, "sampling.cache.threshold=10")
    skipped = always.draw()
    assert always.counted("feed-forward") == always.passes() == {attribute: 1 for attribute in CALLS[model]}
    assert always.passes("calls") == CALLS[model]
    assert 1e-4 < (skipped - plain).abs().max() and (skipped - plain).abs().mean() < 0.05


# diffusers' TaylorSeer computes a module at its first 3 calls, then at every second from the 5th
# (calls 4, 6, ...) and predicts it between: 3 of the first expert's 4 calls, 5 of the second's 8,
# 7 of the one transformer's 12; each expert counts its own calls.
FULL_PASSES = {"tiny_wan": {"transformer": 3, "transformer_2": 5}, "tiny_wan_ti2v": {"transformer": 7}}


@pytest.mark.parametrize("model", CALLS)
def test_taylorseer_runs_each_experts_attention_or_whole_blocks_on_about_half_its_calls(model_cache, model):
    plain = Videos(model).draw()
    every_second = ["sampling.cache.interval=2"]
    attention = Videos(model, "sampling.cache.method=taylorseer", *every_second)
    predicted_attention = attention.draw()
    # Only the attention is predicted: the feed-forward layers still run at every call.
    assert attention.counted("attention") == attention.passes() == FULL_PASSES[model]
    assert attention.counted("feed-forward") == CALLS[model]
    blocks = Videos(model, "sampling.cache.method=taylorseer_blocks", *every_second)
    predicted_blocks = blocks.draw()
    assert blocks.counted("attention") == blocks.counted("feed-forward") == blocks.passes() == FULL_PASSES[model]
    # Close to the uncached video (frames in [0, 1]: 0.0005 to 0.003 on average here), not equal to it.
    for video in (predicted_attention, predicted_blocks):
        difference = (video - plain).abs()
        assert difference.max() > 1e-4 and difference.mean() < 0.02


# With one full pass before TaylorSeer predicts (sampling.cache.warmup=1): each expert's calls 1, 3,
# 5, ... computed, the others predicted.
FULL_PASSES_AFTER_ONE = {"tiny_wan": {"transformer": 2, "transformer_2": 4}, "tiny_wan_ti2v": {"transformer": 6}}


@pytest.mark.parametrize("model", CALLS)
def test_taylorseer_with_one_warm_up_pass_predicts_from_each_experts_second_call(model_cache, model):
    plain = Videos(model).draw()
    blocks = Videos(model, "sampling.cache.method=taylorseer_blocks", "sampling.cache.interval=2",
                    "sampling.cache.warmup=1")
    predicted = blocks.draw()
    assert blocks.counted("feed-forward") == blocks.passes() == FULL_PASSES_AFTER_ONE[model]
    difference = (predicted - plain).abs()
    assert difference.max() > 1e-4 and difference.mean() < 0.02


def test_taylorseer_takes_an_interval_per_expert(model_cache):
    """backbone_intervals gives the low-noise expert its own interval: each expert computes as many
    full passes as it does with that interval for both."""
    plain = Videos("tiny_wan").draw()
    blocks = ["sampling.cache.method=taylorseer_blocks", "sampling.cache.warmup=1"]
    passes = {}
    for interval in (2, 4):
        videos = Videos("tiny_wan", *blocks, f"sampling.cache.interval={interval}")
        videos.draw()
        passes[interval] = videos.counted("feed-forward")
    assert passes[4]["transformer_2"] < passes[2]["transformer_2"]
    mixed = Videos("tiny_wan", *blocks, "sampling.cache.interval=2",
                   "+sampling.cache.backbone_intervals={transformer_2:4}")
    difference = (mixed.draw() - plain).abs()
    assert mixed.counted("feed-forward") == {"transformer": passes[2]["transformer"],
                                              "transformer_2": passes[4]["transformer_2"]}
    assert difference.max() > 1e-4 and difference.mean() < 0.02
    assert "transformer_2 every 4" in mixed.first.cache.describe()


def test_first_block_cache_takes_a_threshold_per_expert(model_cache):
    """backbone_thresholds gives the named expert its own threshold: past any change for the
    high-noise expert (its blocks at its first call only), never skipping for the low-noise one (every
    call in full), each as that threshold for both would run it."""
    mixed = Videos("tiny_wan", *FIRST_BLOCK, "sampling.cache.threshold=10",
                   "+sampling.cache.backbone_thresholds={transformer_2:0}")
    mixed.draw()
    assert mixed.counted("feed-forward") == {"transformer": 1, "transformer_2": CALLS["tiny_wan"]["transformer_2"]}
    assert mixed.first.cache.describe() == "First Block Cache, threshold 10.0, transformer_2 0.0"


def test_first_block_cache_runs_a_fixed_schedule_in_place_of_the_threshold(model_cache):
    """backbone_full_steps runs the named expert's blocks at those of its steps and skips the rest,
    whatever its threshold: at threshold 0 (never skip) a schedule of the first step alone draws, bit
    for bit, what a threshold past any change draws (both compute once and reuse). The schedule starts
    again with each video."""
    reused = Videos("tiny_wan", *FIRST_BLOCK, "sampling.cache.threshold=10").draw()
    scheduled = Videos("tiny_wan", *FIRST_BLOCK, "sampling.cache.threshold=0",
                       "+sampling.cache.backbone_full_steps={transformer:[0],transformer_2:[0]}")
    assert torch.equal(scheduled.draw(), reused)
    assert scheduled.counted("feed-forward") == {"transformer": 1, "transformer_2": 1}
    mixed = Videos("tiny_wan", *FIRST_BLOCK, "sampling.cache.threshold=10",
                   "+sampling.cache.backbone_full_steps={transformer_2:[0,3,6]}")
    first = mixed.draw()
    assert mixed.counted("feed-forward") == mixed.passes() == {"transformer": 1, "transformer_2": 3}
    assert torch.equal(mixed.draw(), first)
    assert mixed.counted("feed-forward") == {"transformer": 2, "transformer_2": 6}
    assert (first - reused).abs().max() > 1e-5
    assert mixed.first.cache.describe() == ("First Block Cache, transformer_2 in full at steps 0, 3, 6; "
                                            "threshold 10.0 where no schedule is named")
    assert mixed.first.cache.for_backbone("transformer_2").describe() == "First Block Cache, in full at steps 0, 3, 6"


def test_a_schedule_naming_steps_a_video_never_reaches_is_told_once(model_cache):
    """How many steps an expert runs follows from the call's steps and the boundary: a schedule's step
    past them is named in a warning after the first video, and not again on the next."""
    past = Videos("tiny_wan", *FIRST_BLOCK, "+sampling.cache.backbone_full_steps={transformer:[0,1,40]}")
    with pytest.warns(UserWarning, match=r"backbone_full_steps.transformer: steps \[40\] never ran, transformer ran "):
        past.draw()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        past.draw()


def test_taylorseer_of_order_2_predicts_other_steps_from_the_same_full_passes(model_cache):
    """sampling.cache.order reaches diffusers' hooks: at order 2 a prediction made after three full
    passes (the low-noise expert's from its fourth call on) adds a second-order term to the line, so
    the video differs from order 1's while the experts compute the same full passes."""
    plain = Videos("tiny_wan").draw()
    blocks = ["sampling.cache.method=taylorseer_blocks", "sampling.cache.interval=2", "sampling.cache.warmup=1"]
    line, second = Videos("tiny_wan", *blocks), Videos("tiny_wan", *blocks, "sampling.cache.order=2")
    by_line, by_second = line.draw(), second.draw()
    assert second.counted("feed-forward") == line.counted("feed-forward") == FULL_PASSES_AFTER_ONE["tiny_wan"]
    assert (by_second - by_line).abs().max() > 1e-5
    assert (by_second - plain).abs().mean() < 0.02
    assert second.first.cache.describe().endswith("order 2") and "order" not in line.first.cache.describe()


def test_the_benchmarks_cache_setting_names_an_interval_or_threshold_per_expert():
    import re
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from harness.caches import SETTING, cache_block, hook_cache
    from sdquant.families.wan.family import BLOCK_STACKS

    setting = "taylorseer_blocks:3:1:transformer_2=4"
    assert cache_block(setting) == {"method": "taylorseer_blocks", "interval": 3, "warmup": 1,
                                    "backbone_intervals": {"transformer_2": 4}}
    # The peer's hook: each expert of diffusers' pipeline takes its own.
    hook = hook_cache(setting, BLOCK_STACKS)
    assert (hook.for_backbone("transformer").interval, hook.for_backbone("transformer_2").interval) == (3, 4)
    assert re.fullmatch(SETTING, setting) and not re.fullmatch(SETTING, "taylorseer_blocks:3:1:transformer_2")
    per_threshold = "first_block:0.2:transformer_2=0.25"
    assert cache_block(per_threshold) == {"method": "first_block", "threshold": 0.2,
                                          "backbone_thresholds": {"transformer_2": 0.25}}
    hook = hook_cache(per_threshold, BLOCK_STACKS)
    assert (hook.for_backbone("transformer").threshold, hook.for_backbone("transformer_2").threshold) == (0.2, 0.25)
    assert re.fullmatch(SETTING, per_threshold) and not re.fullmatch(SETTING, "first_block:0.2:transformer_2")
    scheduled = "first_block_steps:transformer=0/1/4,transformer_2=0/7/11"
    assert cache_block(scheduled) == {"method": "first_block",
                                      "backbone_full_steps": {"transformer": [0, 1, 4], "transformer_2": [0, 7, 11]}}
    assert re.fullmatch(SETTING, scheduled) and not re.fullmatch(SETTING, "first_block_steps:transformer=0/")


@pytest.mark.parametrize("setting, shares, schedule", [
    ("first_block:0", (1.0, 1.0), {"transformer": [0, 1, 2, 3], "transformer_2": list(range(8))}),
    ("first_block:0:transformer_2=10", (1.0, 2 / 16), {"transformer": [0, 1, 2, 3], "transformer_2": [0]}),
    ("taylorseer_blocks:2:1", (2 / 4, 4 / 8), {"transformer": [0, 2], "transformer_2": [0, 2, 4, 6]})])
def test_cache_passes_counts_the_calls_each_expert_ran_in_full(tmp_path, model_cache, setting, shares, schedule):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from cache_passes import main, parse

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox runs through the snow\n")
    counted = main(parse(["--model", "tiny_wan", "--cache", setting, "--prompts-file", str(prompts),
                          "--steps", str(STEPS)]))
    assert tuple(counted["full_pass_share"][name] for name in ("transformer", "transformer_2")) == shares
    assert counted["schedule"] == schedule
    assert counted["counts"]["transformer"]["calls"] * 2 == counted["counts"]["transformer_2"]["calls"]


def test_cache_passes_counts_under_the_attention_window(tmp_path, model_cache):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from cache_passes import main, parse

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox runs through the snow\n")
    arguments = ["--model", "tiny_wan", "--cache", "first_block:0", "--prompts-file", str(prompts),
                 "--steps", str(STEPS)]
    counted = main(parse([*arguments, "--window-frames", "1"]))
    assert counted["window"] == {"frames": 1}
    assert counted["full_pass_share"] == {"transformer": 1.0, "transformer_2": 1.0}
    with pytest.raises(SystemExit):
        parse([*arguments, "--window-min-share", "0.9"])


@pytest.mark.parametrize("cache", [[*FIRST_BLOCK, "sampling.cache.threshold=10"],
                                   ["sampling.cache.method=taylorseer_blocks", "sampling.cache.interval=2"]],
                         ids=["first_block", "taylorseer_blocks"])
def test_every_expert_starts_its_hook_afresh_with_each_video(model_cache, cache):
    """The low-noise expert's hook too: left as the first video ended it, the second video's calls
    of it would compare with (or extrapolate from) the first's."""
    videos = Videos("tiny_wan", *cache)
    first = videos.draw()
    once = videos.counted("feed-forward")
    assert torch.equal(videos.draw(), first)
    assert videos.counted("feed-forward") == {attribute: 2 * n for attribute, n in once.items()}


def kept_by_hooks(transformer) -> int:
    """Bytes of the tensors the transformer's cache hooks keep of its earlier calls."""
    def nbytes(value) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, dict):
            return sum(nbytes(item) for item in value.values())
        if isinstance(value, (list, tuple)):
            return sum(nbytes(item) for item in value)
        return 0
    kept = 0
    for module in transformer.modules():
        registry = getattr(module, "_diffusers_hook", None)
        for hook in (registry.hooks.values() if registry is not None else ()):
            manager = getattr(hook, "state_manager", None)
            kept += sum(nbytes(vars(state)) for state in (manager._state_cache.values() if manager else ()))
    return kept


@pytest.mark.parametrize("cache", [[*FIRST_BLOCK, "sampling.cache.threshold=10"],
                                   ["sampling.cache.method=taylorseer_blocks", "sampling.cache.interval=2"]],
                         ids=["first_block", "taylorseer_blocks"])
def test_the_decoder_runs_with_no_cache_state_left_on_the_experts(model_cache, cache):
    """Past the last step the caches' state is of no use: kept, it takes the room the decoder's
    activations need (at 720p, 8.7 GiB under First Block Cache)."""
    videos = Videos("tiny_wan", *cache)
    experts = [stage.transformer for stage in videos.flow.stages.values() if hasattr(stage, "passes")]
    kept_after_calls, kept_at_decode = [], []

    def kept() -> int:
        return sum(kept_by_hooks(expert) for expert in experts)
    for expert in experts:
        expert.register_forward_hook(lambda *_: kept_after_calls.append(kept()))
    decoder = videos.flow.stages["vae"]
    videos.flow.stages["vae"] = lambda **inputs: (kept_at_decode.append(kept()), decoder(**inputs))[1]
    videos.draw()
    assert len(kept_after_calls) >= STEPS and min(kept_after_calls) > 0
    assert kept_at_decode == [0]


def test_evaluate_scores_a_cached_variant_of_both_experts_and_takes_the_hooks_off_again(tmp_path, model_cache):
    report = run_evaluate(compose_config("sd_xl_evaluate", [
        "model=tiny_wan", "device=cpu", f"out_path={tmp_path}", "sampling.prompts=['a red fox runs through the snow']",
        "sampling.steps=8", "+variants.hooked=null", "+variants.same=null",
        "+variant_cache={hooked:{method:first_block,threshold:10}}"]))
    hooked, same = report["variants"]["hooked"], report["variants"]["same"]
    # Teacher-forced, each expert's first call starts its hook afresh and computes every block;
    # its later calls reuse the residual (8 steps: 3 calls of the first expert, 5 of the second).
    errors = hooked["step_error_by_backbone"]
    assert {graph: len(calls) for graph, calls in errors.items()} == {"transformer": 3, "transformer_2": 5}
    assert all(calls[0] == 0.0 and 0 < min(calls[1:]) < 0.5 for calls in errors.values())
    assert "cached (First Block Cache, threshold 10.0)" in hooked["source"]
    assert same["step_error"] == [0.0] * 8, "the hooks are off the experts for the next variant"


def test_taylorseer_names_the_attention_modules_of_every_block():
    """diffusers' default patterns hook Flux's attention (`attn`) but none of Wan's (`attn1`, `attn2`):
    the modules are named one by one, the same ones in Flux."""
    from diffusers.hooks import TaylorSeerCacheConfig

    from sdquant.families.flux.family import BLOCK_STACKS, FLUX
    from sdquant.families.flux.sizes import TINY as TINY_FLUX
    from sdquant.families.wan import WAN
    from sdquant.families.wan.family import BLOCK_STACKS as WAN_BLOCK_STACKS
    from sdquant.families.wan.sizes import expert as wan_expert
    from sdquant.runtime.cache_hooks import HookCache

    def hooked(module) -> set[str]:
        return {name for name, layer in module.named_modules()
                if "taylorseer_cache" in getattr(getattr(layer, "_diffusers_hook", None), "hooks", {})}

    def under(config, module) -> set[str]:
        module.enable_cache(config)
        names = hooked(module)
        module.disable_cache()
        return names

    expert = wan_expert(WAN.sizes["tiny"])
    assert not under(TaylorSeerCacheConfig(cache_interval=2), expert)
    ours = HookCache("taylorseer", 2, 0.0, WAN_BLOCK_STACKS)
    assert under(ours.config(expert), expert) == {f"blocks.{index}.attn{which}" for index in range(5)
                                                   for which in (1, 2)}
    transformer = FLUX.build_pipeline(TINY_FLUX).transformer
    defaults = under(TaylorSeerCacheConfig(cache_interval=2), transformer)
    assert len(defaults) == 4 and under(HookCache("taylorseer", 2, 0.0, BLOCK_STACKS).config(transformer),
                                        transformer) == defaults


@pytest.mark.parametrize("overrides, message", [
    ([*FIRST_BLOCK, "sampling.cache.threshold=-0.1"], "sampling.cache.threshold=-0.1: give 0 (never skip) or more"),
    (["sampling.cache.method=taylorseer", "sampling.cache.interval=0"],
     "sampling.cache.interval=0: give a full pass every 1 or more steps"),
    (["sampling.cache.method=taylorseer_blocks", "sampling.cache.warmup=0"],
     "sampling.cache.warmup=0: give 1 or more full passes before TaylorSeer predicts"),
    (["model=tiny_wan_ti2v", "sampling.cache.method=taylorseer_blocks", "sampling.cache.interval=0"],
     "sampling.cache.interval=0: give a full pass every 1 or more steps"),
    (["sampling.cache.method=deepcache"], "sampling.cache.method=deepcache: model=tiny_wan's transformer and "
                                          "transformer_2 take none or first_block or taylorseer or taylorseer_blocks"),
    ([*FIRST_BLOCK, "backend=onnxruntime"], "is a diffusers hook on the transformer module: run it with backend=torch"),
    ([*FIRST_BLOCK, "+sampling.cache.backbone_intervals={transformer_2:4}"],
     "sampling.cache.backbone_intervals: only TaylorSeer (taylorseer and taylorseer_blocks) takes an interval a "
     "backbone, not first_block"),
    (["sampling.cache.method=taylorseer_blocks", "+sampling.cache.backbone_intervals={unet:4}"],
     "sampling.cache.backbone_intervals: model=tiny_wan has no backbone unet: name transformer or transformer_2"),
    (["sampling.cache.method=taylorseer_blocks", "+sampling.cache.backbone_intervals={transformer_2:0}"],
     "sampling.cache.backbone_intervals.transformer_2=0: give a full pass every 1 or more steps"),
    (["sampling.cache.method=taylorseer_blocks", "sampling.cache.order=0"],
     "sampling.cache.order=0: give 1 (a line through the last two full passes) or more"),
    ([*FIRST_BLOCK, "sampling.cache.order=2"],
     "sampling.cache.order=2: only TaylorSeer (taylorseer and taylorseer_blocks) extrapolates, not first_block"),
    (["sampling.cache.method=taylorseer_blocks", "+sampling.cache.backbone_thresholds={transformer_2:0.3}"],
     "sampling.cache.backbone_thresholds: only first_block takes a threshold a backbone, not taylorseer_blocks"),
    ([*FIRST_BLOCK, "+sampling.cache.backbone_thresholds={unet:0.3}"],
     "sampling.cache.backbone_thresholds: model=tiny_wan has no backbone unet: name transformer or transformer_2"),
    ([*FIRST_BLOCK, "+sampling.cache.backbone_thresholds={transformer_2:-0.1}"],
     "sampling.cache.backbone_thresholds.transformer_2=-0.1: give 0 (never skip) or more"),
    (["sampling.cache.method=taylorseer_blocks", "+sampling.cache.backbone_full_steps={transformer:[0,2]}"],
     "sampling.cache.backbone_full_steps: only first_block takes a schedule a backbone, not taylorseer_blocks"),
    ([*FIRST_BLOCK, "+sampling.cache.backbone_full_steps={transformer_2:[2,4]}"],
     "sampling.cache.backbone_full_steps.transformer_2=[2, 4]: give the steps that run in full, 0 among them"),
    ([*FIRST_BLOCK, "+sampling.cache.backbone_full_steps={transformer_2:[0,4]}",
      "+sampling.cache.backbone_thresholds={transformer_2:0.3}"],
     "sampling.cache.backbone_thresholds.transformer_2: transformer_2 runs on its backbone_full_steps schedule"),
], ids=["threshold", "interval", "warmup", "ti2v_interval", "deepcache", "graphs", "intervals_method",
        "intervals_backbone", "intervals_value", "order_value", "order_method", "thresholds_method",
        "thresholds_backbone", "thresholds_value", "schedule_method", "schedule_value", "schedule_and_threshold"])
def test_a_cache_value_the_experts_cannot_take_is_refused_in_one_line(tmp_path, model_cache, capsys, overrides,
                                                                     message):
    out = tmp_path / "videos"
    cfg = compose_config("sd_xl_trt_inference", ["model=tiny_wan", *RUN, f"out_path={out}", *overrides])
    assert message in refused_in_one_line(run_infer, cfg, capsys)
    assert not out.exists()


def test_a_refusal_that_builds_the_tiny_model_first_is_still_one_line(tmp_path, monkeypatch, capsys):
    """The first use of a tiny model builds it into the cache; a value refused after that build
    still leaves the console one line."""
    import transformers

    # As a fresh process has it: an earlier test on this worker may have quieted the libraries.
    transformers.utils.logging.enable_progress_bar()
    monkeypatch.setenv("SDQUANT_CACHE", str(tmp_path / "fresh_cache"))
    cfg = compose_config("sd_xl_trt_inference", ["model=tiny_wan", *RUN, f"out_path={tmp_path / 'videos'}",
                                                 "sampling.cache.method=taylorseer", "sampling.cache.order=0"])
    assert "sampling.cache.order=0" in refused_in_one_line(run_infer, cfg, capsys)
    assert (tmp_path / "fresh_cache" / "tiny_wan" / "model_index.json").exists()


def test_a_compiled_expert_under_taylorseer_compiles_once_not_at_each_step(model_cache):
    """Warmed by a call of 2 steps, a call of 12 compiles nothing and draws what the eager experts
    draw under the same hook: the hook's update runs outside the graphs, which otherwise specialized
    on its step counter and compiled again at each full pass."""
    from torch._dynamo.utils import counters

    cache = {"method": "taylorseer_blocks", "interval": 2, "warmup": 1}
    prompt = "a red fox runs through the snow"
    with load_api("tiny_wan", backend="torch", device="cpu", torch_backend={"compile": True},
                  sampling={"cache": cache}) as compiled:
        compiled(prompt, seed=1, steps=2)
        warm = counters["stats"]["unique_graphs"]
        drawn = compiled(prompt, seed=2, steps=STEPS)
        assert counters["stats"]["unique_graphs"] == warm
    # The hook's state, read after each compiled call, counts what the eager flow's layers show, for
    # each guidance half (the torch backend calls an expert one sample at a time).
    assert {name: {key: each[key] for key in ("full_passes", "calls")} for name, each in drawn.cache_passes.items()} \
        == {name: {"full_passes": 2 * full, "calls": 2 * CALLS["tiny_wan"][name]}
            for name, full in FULL_PASSES_AFTER_ONE["tiny_wan"].items()}
    # Each guidance half in full at the expert's steps 0 and 2 of 4.
    assert drawn.cache_passes["transformer"]["full_steps"] == [2, 0, 2]
    drawn = drawn.samples
    with load_api("tiny_wan", backend="torch", device="cpu", sampling={"cache": cache}) as eager:
        expected = eager(prompt, seed=2, steps=STEPS).samples
    # Measured: 3e-5 apart; the cache itself moves the video by 0.02.
    assert (drawn - expected).abs().max() < 1e-3


def test_infer_reports_the_calls_each_expert_ran_in_full_under_a_cache(tmp_path, model_cache, capsys):
    cfg = compose_config("sd_xl_trt_inference", ["model=tiny_wan", *RUN, f"out_path={tmp_path}",
                                                 "sampling.cache.method=taylorseer_blocks", "sampling.cache.interval=2",
                                                 "sampling.cache.warmup=1"])
    latency = run_infer(cfg)
    # Each guidance half its own call, in its own cache context.
    assert latency["cache_passes"] == {"transformer": {"full_passes": 4, "calls": 8, "full_steps": [2, 0, 2]},
                                       "transformer_2": {"full_passes": 8, "calls": 16,
                                                         "full_steps": [2, 0, 2, 0, 2, 0, 2]}}
    assert json.loads((tmp_path / "latency.json").read_text())["cache_passes"] == latency["cache_passes"]
    assert "run in full over the timed call(s): transformer 4 of 8, transformer_2 8 of 16" in capsys.readouterr().out


def test_a_compiled_expert_under_first_block_cache_counts_its_full_passes(model_cache):
    """Past any change (threshold 10), each guidance half's cache context runs the high-noise expert
    in full at its first call only, and the low-noise one on its schedule (steps 0 and 3, given
    unsorted); counted the same compiled as eager."""
    cache = {"method": "first_block", "threshold": 10.0, "backbone_full_steps": {"transformer_2": [3, 0]}}
    expected = {"transformer": {"full_passes": 2, "calls": 2 * CALLS["tiny_wan"]["transformer"], "full_steps": [2]},
                "transformer_2": {"full_passes": 4, "calls": 2 * CALLS["tiny_wan"]["transformer_2"],
                                  "full_steps": [2, 0, 0, 2]}}
    for compile in (True, False):
        with load_api("tiny_wan", backend="torch", device="cpu", torch_backend={"compile": compile},
                      sampling={"cache": cache}) as pipe:
            assert pipe("a red fox runs through the snow", seed=1, steps=STEPS).cache_passes == expected
