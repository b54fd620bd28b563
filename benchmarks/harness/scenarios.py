"""The headline rows of each family: the peer (what a user runs instead), ours in 16 bits, ours in
FP8, and ours in FP8 with its step cache, each one process of a benchmark script, and where each
row's quality figure comes from; and the setting each served model's serving figures are measured at.

Every row pins its attention kernel, so that a ratio compares like with like: the peer takes the
best its library offers that pip installs (diffusers' default, torch's SDPA, where no
FlashAttention-3 is installed), ours the same, and where ours runs faster on a kernel the peer
cannot use (FlashAttention-3 in FP8), that row stands beside the one on the peer's kernel.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Quality:
    """Where a row's quality figure is: a summary of benchmarks/quality_over_calibrations.py (the
    mean over calibrations with its range), the setting's key in it, and the figure judged."""

    summary: str
    setting: str | None  # None: the unquantized reference
    judged: str


@dataclasses.dataclass(frozen=True)
class Row:
    key: str  # the row's name in the headline results
    label: str  # what the README's table calls it
    side: str  # "peer" or "ours"
    args: tuple[str, ...]  # the benchmark script's arguments for this row alone
    variant: str  # the name the script gives the row in its results
    attention: str  # the attention kernel the row runs: torch (SDPA, cuDNN's FP8) or flash3
    needs: str = ""  # what a user installs beyond `pip install -e .` to reach it
    quality: Quality | None = None


@dataclasses.dataclass(frozen=True)
class Scenario:
    family: str
    title: str  # the table's caption: model, geometry, steps, batch
    script: str  # the benchmark script under benchmarks/
    common: tuple[str, ...]  # arguments every row takes
    unit: str  # what `seconds` times
    rate: str  # what a call makes, for a rate column ("images"); "" where a rate says nothing (a step)
    per_call: int  # how many of them one timed call makes
    seconds_key: tuple[str, ...]  # the path to the timed seconds in a row of the script's results
    rows: tuple[Row, ...]

    def row(self, key: str) -> Row:
        return next(row for row in self.rows if row.key == key)


SDXL_QUALITY = "benchmarks/results/quality_means_scenes_sdxl_cpu_summary.json"
FLUX_QUALITY = "benchmarks/results/quality_means_scenes_flux_cpu_fp8_summary.json"
WAN_QUALITY = "benchmarks/results/quality_means_scenes_wan_cpu_fp8_summary.json"
WAN_CACHED_QUALITY = "benchmarks/results/quality_means_scenes_wan_cpu_cached_summary.json"
# torchao's dynamic FP8 on the scene models' Linear layers (benchmarks/peer_quality.py): one run each.
SDXL_TORCHAO_QUALITY = "benchmarks/results/quality_means_scenes_sdxl_cpu_torchao_summary.json"
FLUX_TORCHAO_QUALITY = "benchmarks/results/quality_means_scenes_flux_cpu_torchao_summary.json"
FP8_ATTENTION = "fp8-attention extra"
FLASH3 = "fp8-attention extra, a Hopper GPU"
TORCHAO = "peers extra (torchao)"


# A whole video's warm-up where what compiles does not depend on the step count: 4 of the A14B's
# steps (flow shift 3) call each expert twice, a full pass and, under TaylorSeer every 2 steps
# after one, a prediction. diffusers' own hook compiles again at each full pass: the peer's cached
# row warms with the whole video.
SHORT_WARM_UP = ("--warm-steps", "4")
# First Block Cache on the schedule its thresholds (0.20 high-noise, 0.25 low-noise) ran under the
# heads' window over the Wan scene model's validation prompts (benchmarks/cache_passes.py). Its warm-up
# needs a skipped step of each expert: 12 steps call the high-noise expert at its steps 0 to 3 (8 at
# 0 to 2 alone, all three in full, and the skipped call compiled while timed: tiny_wan, 2 graphs).
WAN_SCHEDULE = "first_block_steps:transformer=0/1/2,transformer_2=0/7/11"
WAN_SCHEDULE_QUALITY = "benchmarks/results/quality_means_scenes_wan_cpu_fp8_window_first_block_steps_summary.json"
SCHEDULE_WARM_UP = ("--warm-steps", "12")


def wan_step_rows(quality_summary: str | None) -> tuple[Row, ...]:
    """A Wan2.2 step's rows (wan_full_size.py), judged on the scene model's summary where there is one."""

    def quality(setting: str | None) -> Quality | None:
        return Quality(quality_summary, setting, "all prompts") if quality_summary else None

    return (
        Row("peer", "diffusers' compiled transformer", "peer", ("--variants", "peer", "--attention-kernel", "torch"),
            "peer_torch", "torch", quality=quality(None)),
        Row("ours_16bit", "ours, bf16 compiled", "ours", ("--variants", "compiled", "--attention-kernel", "torch"),
            "compiled_torch", "torch", quality=quality(None)),
        Row("ours_fp8", "ours, FP8 level 4", "ours", ("--variants", "fp8_l4", "--attention-kernel", "torch"),
            "fp8_l4_torch", "torch", FP8_ATTENTION, quality("fp8_l4")),
        Row("ours_fp8_flash3", "ours, FP8 level 4 on FlashAttention-3", "ours",
            ("--variants", "fp8_l4", "--attention-kernel", "flash3"), "fp8_l4_flash3", "flash3", FLASH3,
            quality("fp8_l4")),
    )


SCENARIOS = {
    "sdxl": Scenario(
        family="sdxl", title="SDXL, 1024x1024, 20 steps, 8 images a call", script="torch_backend_full_size.py",
        common=("--batch", "8", "--steps", "20", "--runs", "3"), unit="s a call", rate="images", per_call=8,
        seconds_key=("20_steps", "best_s"),
        rows=(
            Row("peer", "diffusers' compiled pipeline", "peer", ("--variants", "peer"), "peer", "torch",
                quality=Quality(SDXL_QUALITY, None, "two objects")),
            Row("peer_torchao",
                "diffusers' compiled pipeline + torchao's dynamic FP8 (per row, bf16), torch's compiler defaults",
                "peer", ("--variants", "torchao_row"), "torchao_row", "torch", TORCHAO,
                Quality(SDXL_TORCHAO_QUALITY, "torchao_row", "two objects")),
            Row("ours_16bit", "ours, fp16 compiled + CUDA graphs", "ours", ("--variants", "compiled"), "compiled",
                "torch", quality=Quality(SDXL_QUALITY, None, "two objects")),
            Row("ours_fp8", "ours, FP8 level 3", "ours", ("--variants", "fp8"), "fp8", "torch",
                quality=Quality(SDXL_QUALITY, "fp8_l3", "two objects")),
            Row("ours_fp8_cache", "ours, FP8 level 3 + DeepCache every 2 steps", "ours",
                ("--variants", "fp8", "--cache-interval", "2"), "fp8_deepcache_i2_b0", "torch",
                quality=Quality(SDXL_QUALITY, "fp8_l3_deepcache2", "two objects")),
        )),
    "flux": Scenario(
        family="flux", title="Flux.1-dev, 1024x1024, 28 steps, one image", script="flux_full_size.py",
        common=("--runs", "3"), unit="s an image", rate="images", per_call=1, seconds_key=("best_s",),
        rows=(
            Row("peer", "diffusers' compiled pipeline", "peer", ("--variants", "peer", "--attention-kernel", "torch"),
                "peer_torch", "torch", quality=Quality(FLUX_QUALITY, None, "two objects")),
            Row("peer_torchao", "diffusers' compiled pipeline + torchao's dynamic FP8 (per row), torch's compiler defaults",
                "peer", ("--variants", "torchao_row", "--attention-kernel", "torch"), "torchao_row_torch", "torch",
                TORCHAO, Quality(FLUX_TORCHAO_QUALITY, "torchao_row", "two objects")),
            Row("ours_16bit", "ours, bf16 compiled + CUDA graphs", "ours",
                ("--variants", "compiled", "--attention-kernel", "torch"), "compiled_torch", "torch",
                quality=Quality(FLUX_QUALITY, None, "two objects")),
            Row("ours_fp8", "ours, FP8 level 4", "ours", ("--variants", "fp8_l4", "--attention-kernel", "torch"),
                "fp8_l4_torch", "torch", FP8_ATTENTION, Quality(FLUX_QUALITY, "fp8_l4", "two objects")),
            Row("ours_fp8_cache", "ours, FP8 level 4 + TaylorSeer over blocks every 2 steps", "ours",
                ("--variants", "fp8_l4", "--attention-kernel", "torch", "--cache", "taylorseer_blocks:2"),
                "fp8_l4_taylorseer_blocks_2_torch", "torch", FP8_ATTENTION,
                Quality(FLUX_QUALITY, "fp8_l4_taylorseer_blocks2", "two objects")),
        )),
    "sd35": Scenario(
        family="sd35", title="SD3.5 Large, 1024x1024, 28 steps, one image (no scene model: unscored)",
        script="sd35_full_size.py", common=("--runs", "3"), unit="s an image", rate="images", per_call=1,
        seconds_key=("best_s",),
        rows=(
            Row("peer", "diffusers' compiled pipeline", "peer", ("--variants", "peer", "--attention-kernel", "torch"),
                "peer_torch", "torch"),
            Row("ours_16bit", "ours, bf16 compiled + CUDA graphs", "ours",
                ("--variants", "compiled", "--attention-kernel", "torch"), "compiled_torch", "torch"),
            Row("ours_fp8", "ours, FP8 level 4", "ours", ("--variants", "fp8_l4", "--attention-kernel", "torch"),
                "fp8_l4_torch", "torch", FP8_ATTENTION),
        )),
    "wan": Scenario(
        family="wan", title="Wan2.2-T2V-A14B, one denoising step (both guidance halves), 720x1280, 81 frames",
        script="wan_full_size.py", common=("--calls", "2"), unit="s a step", rate="", per_call=1,
        seconds_key=("step_s",),
        rows=wan_step_rows(WAN_QUALITY)),
    # The cached video, both sides under TaylorSeer over whole blocks: the uncached comparison is the
    # step's ("wan"), and the five rows of a cached and an uncached video each side (each warmed by a
    # video of its own, the peer's hook compiling anew at each full pass) take longer than one lease
    # of a GPU, where these fit. Then ours at the fewest full calls within every quality bound: the
    # heads' window under First Block Cache on the schedule its thresholds ran on the scene model's
    # validation prompts (cache_passes.py), which diffusers' pipeline cannot run (no fixed schedule),
    # and which random weights could not decide by a threshold.
    "wan_video": Scenario(
        family="wan_video",
        title="Wan2.2-T2V-A14B, one video at MLPerf's settings (720x1280, 81 frames, 20 steps) under a step cache",
        script="wan_full_size.py", common=("--whole",), unit="s a video", rate="videos", per_call=1,
        seconds_key=("video_s",),
        rows=(
            Row("peer", "diffusers' WanPipeline, experts compiled, diffusers' TaylorSeer hook every 2 steps after 1",
                "peer",
                ("--variants", "peer", "--attention-kernel", "torch", "--cache", "taylorseer_blocks:2:1"),
                "peer_video_taylorseer_blocks_2_1_torch", "torch",
                quality=Quality(WAN_CACHED_QUALITY, "fp16_taylorseer_blocks2_warmup1", "all prompts")),
            Row("ours_fp8_cache", "ours, FP8 level 4, the same hook", "ours",
                ("--variants", "fp8_l4", "--attention-kernel", "torch", "--cache", "taylorseer_blocks:2:1",
                 *SHORT_WARM_UP), "fp8_l4_video_taylorseer_blocks_2_1_torch", "torch", FP8_ATTENTION,
                Quality(WAN_QUALITY, "fp8_l4_taylorseer_blocks2_warmup1", "all prompts")),
            Row("ours_fp8_cache_flash3", "ours, FP8 level 4, the same hook, on FlashAttention-3", "ours",
                ("--variants", "fp8_l4", "--attention-kernel", "flash3", "--cache", "taylorseer_blocks:2:1",
                 *SHORT_WARM_UP), "fp8_l4_video_taylorseer_blocks_2_1_flash3", "flash3", FLASH3,
                Quality(WAN_QUALITY, "fp8_l4_taylorseer_blocks2_warmup1", "all prompts")),
            Row("ours_fp8_window_schedule_flash3",
                "ours, FP8 level 4 on FlashAttention-3, 30% of the heads within 3 frames, First Block Cache on "
                "the scene model's schedule (6 of 20 steps in full)", "ours",
                ("--variants", "fp8_l4", "--attention-kernel", "flash3", "--cache", WAN_SCHEDULE, "--window", "3",
                 "--window-heads", "0.3", *SCHEDULE_WARM_UP),
                "fp8_l4_video_first_block_steps_transformer_0_1_2_transformer_2_0_7_11_flash3_window3_heads30",
                "flash3", FLASH3,
                Quality(WAN_SCHEDULE_QUALITY, "fp8_l4_window1_heads90_first_block_steps_h012_l0711", "all prompts")),
        )),
    # Attention that computes less: the high-noise expert's step with its self-attention within a window
    # of 3 latent frames (of the video's 21), one call a frame over its window's keys: for every head
    # (the bound of what the window gives), then for a share of each layer's heads, the others over
    # every key, as a heads file recorded on the model chooses them. A speed screen beside the
    # window's quality on the scene model (docs/models.md), not a headline.
    "wan_window": Scenario(
        family="wan_window",
        title="Wan2.2-T2V-A14B, one denoising step (both guidance halves), 720x1280, 81 frames (21 latent), "
              "self-attention within a window of latent frames",
        script="wan_full_size.py", common=("--calls", "2"), unit="s a step", rate="", per_call=1,
        seconds_key=("step_s",),
        rows=(
            *(row for row in wan_step_rows(None) if row.key in ("peer", "ours_fp8", "ours_fp8_flash3")),
            Row("ours_fp8_flash3_window3", "ours, FP8 level 4 on FlashAttention-3, within 3 frames", "ours",
                ("--variants", "fp8_l4", "--attention-kernel", "flash3", "--window", "3"), "fp8_l4_flash3_window3",
                "flash3", FLASH3),
            *(Row(f"ours_fp8_flash3_window3_heads{percent}",
                  f"ours, FP8 level 4 on FlashAttention-3, within 3 frames for {percent}% of the heads", "ours",
                  ("--variants", "fp8_l4", "--attention-kernel", "flash3", "--window", "3", "--window-heads",
                   str(percent / 100)), f"fp8_l4_flash3_window3_heads{percent}", "flash3", FLASH3)
              for percent in (50, 30)),
        )),
    "wan_ti2v": Scenario(
        family="wan_ti2v", title="Wan2.2-TI2V-5B, one denoising step, 704x1280, 121 frames (no scene model: unscored)",
        script="wan_full_size.py", common=("--model", "wan_ti2v", "--calls", "2"), unit="s a step", rate="",
        per_call=1, seconds_key=("step_s",),
        rows=wan_step_rows(None)),
}


def scenario(family: str) -> Scenario:
    if family not in SCENARIOS:
        raise SystemExit(f"--family {family}: choose one of {', '.join(SCENARIOS)}")
    return SCENARIOS[family]


@dataclasses.dataclass(frozen=True)
class Served:
    """A served model's row in the README's serving table: the setting tools/maintainer/serve_measure.sh
    serves it at, and MLPerf's figure for that setting where there is one."""

    title: str
    reference: str = ""


# Keyed by serve_load.py's --model, which names its results file.
SERVING = {
    "sdxl_base": Served("SDXL FP8 level 3, 1024x1024, 20 steps, up to 8 images a call",
                        "NVIDIA TensorRT, MLPerf v4.1: 1.97 per H100, 2.10 per H200"),
    "flux_dev": Served("Flux.1-dev FP8 level 4, 1024x1024, 28 steps, one image a call"),
}
