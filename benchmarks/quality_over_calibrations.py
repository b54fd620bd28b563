"""Quality of each setting the README headlines, as the mean and range over several calibrations:
calibration k takes its own slice of the model's calibration captions (prompts calib_size * k on)
and its own seed (42 + k), so each checkpoint of a recipe sees other prompts and other noise. All
checkpoints and cached settings run in one evaluate.py pass against one unquantized reference on the
scene model's held-out prompts; the summary gives, per setting, the mean, lowest and highest
two-object adherence, adherence over all prompts and PSNR (for a video model also the temporal
figures), and whether the mean stays within 3 points of the unquantized model (of the uncached one
for a cached setting): two-object adherence for an image model, adherence over all prompts for a
video one.

    python benchmarks/quality_over_calibrations.py                      # scenes_sdxl on a CPU
    python benchmarks/quality_over_calibrations.py --model scenes_flux --calib-batch 8 --device cuda --kernels fp8
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from sdquant.config import register_schemas, shipped_model_folder
from quality_recipes import RECIPES, add_kernels_argument, calibrated, evaluate_into_results, held_out_file

RESULTS = Path(__file__).resolve().parent / "results"
DEEPCACHE_2 = "{method:deepcache,interval:2,branch:0}"
TAYLORSEER_BLOCKS_2 = "{method:taylorseer_blocks,interval:2}"


def taylorseer_blocks_after_one(high: int, low: int, order: int = 1) -> str:
    """TaylorSeer over blocks after one full pass, a full pass every `high` steps of the high-noise
    expert and every `low` of the low-noise one, extrapolating to `order`."""
    extrapolated = "" if order == 1 else ",order:%d" % order
    own = "" if low == high else ",backbone_intervals:{transformer_2:%d}" % low
    return "{method:taylorseer_blocks,interval:%d,warmup:1%s%s}" % (high, extrapolated, own)


# One full pass before TaylorSeer's first prediction instead of diffusers' three: what the Wan video's
# speed needs, since each of its two experts starts its own cache.
TAYLORSEER_BLOCKS_2_WARMUP_1 = taylorseer_blocks_after_one(2, 2)
# Fewer full passes: a longer interval for both experts, or for the low-noise expert alone, whose
# output changes far less from step to step (A14B, 20 steps: 7 of the high-noise expert, 13 of the
# low-noise one; full passes 11 at 2 and 2, 8 at 3 and 3 or 2 and 4, 7 at 2 and 6, 3 and 4, 4 and 4).
TAYLORSEER_BLOCKS_WARMUP_1 = {f"{high}_{low}": taylorseer_blocks_after_one(high, low)
                              for high, low in ((3, 3), (2, 4), (2, 6), (3, 4), (4, 4))}
# Some of them with TaylorSeer's second order, to see whether a curvature term predicts the longer gaps better.
TAYLORSEER_BLOCKS_WARMUP_1_ORDER_2 = {f"{high}_{low}": taylorseer_blocks_after_one(high, low, order=2)
                                      for high, low in ((2, 2), (3, 3), (3, 4))}

# First Block Cache: the rest of each expert skipped while its first block's output changes less than
# the threshold, the skipped blocks' residual taken from the last full pass.
FIRST_BLOCK = {percent: "{method:first_block,threshold:%g}" % (percent / 100) for percent in (10, 15, 20, 25, 30)}
# A threshold per expert: (high-noise, low-noise) in hundredths.
FIRST_BLOCK_PER_EXPERT = {(high, low): "{method:first_block,threshold:%g,backbone_thresholds:{transformer_2:%g}}"
                          % (high / 100, low / 100) for high, low in ((20, 25), (25, 20))}

# First Block Cache on fixed schedules: the steps each expert runs in full (high-noise, low-noise),
# read off the decisions of thresholds 0.20 and 0.25 under the heads' window over the 32 validation
# prompts, first calibration (high-noise: steps 0, 1, 4 of one guidance half, 0, 2 of the other;
# low-noise: 0, 7, 11 on 20 prompts, 0, 6, 10, 12 on 12).
FIRST_BLOCK_STEPS = {"h014_l0711": ((0, 1, 4), (0, 7, 11)), "h024_l0711": ((0, 2, 4), (0, 7, 11)),
                     "h012_l0711": ((0, 1, 2), (0, 7, 11)), "h0124_l0711": ((0, 1, 2, 4), (0, 7, 11))}


def first_block_on_steps(high: tuple[int, ...], low: tuple[int, ...]) -> str:
    listed = lambda steps: "[%s]" % ",".join(map(str, steps))
    return "{method:first_block,backbone_full_steps:{transformer:%s,transformer_2:%s}}" % (listed(high), listed(low))


@dataclass(frozen=True)
class Setting:
    """A setting's recipe in quality_recipes.RECIPES (None: the 16-bit backbone), its step cache as
    evaluate.py's variant_cache takes it and its attention window as variant_window takes it (None:
    none)."""

    recipe: str | None
    cache: str | None = None
    window: str | None = None


# Self-attention within N latent frames of each query's (torch_backend.attention_window); the scene
# model's clips have 5 latent frames.
WINDOW_1, WINDOW_2 = "{frames:1}", "{frames:2}"
WINDOW_1_LOW_NOISE = "{frames:1,backbones:[transformer_2]}"
WINDOW_1_BLOCK_0_DENSE = "{frames:1,dense_blocks:[0]}"
# Within 1 frame for the heads of at least a share of their attention there, recorded by infer_trt.py
# (torch_backend.attention_window.record_to) over the 32 validation prompts, unquantized.
WINDOW_SHARES = "benchmarks/results/window_shares_scenes_wan_validation32_w1.json"
WINDOW_1_HEADS = {percent: "{frames:1,heads_file:%s,min_share:%g}" % (WINDOW_SHARES, percent / 100)
                  for percent in (90, 85, 75)}
# Per kind of backbone, setting -> Setting: the speed tables' headline settings and the recipes beside
# them.
SETTINGS = {
    "unet": {"int8_l3": Setting("int8_l3"), "fp8_l3": Setting("fp8_l3"), "fp8_l4": Setting("fp8_l4"),
             "fp16_deepcache2": Setting(None, DEEPCACHE_2), "fp8_l3_deepcache2": Setting("fp8_l3", DEEPCACHE_2)},
    "transformer": {"int8_l3": Setting("int8_l3"), "fp8_l3": Setting("fp8_l3"), "fp8_l4": Setting("fp8_l4"),
                    "fp16_taylorseer_blocks2": Setting(None, TAYLORSEER_BLOCKS_2),
                    "fp16_taylorseer_blocks2_warmup1": Setting(None, TAYLORSEER_BLOCKS_2_WARMUP_1),
                    "fp8_l4_taylorseer_blocks2": Setting("fp8_l4", TAYLORSEER_BLOCKS_2),
                    "fp8_l4_taylorseer_blocks2_warmup1": Setting("fp8_l4", TAYLORSEER_BLOCKS_2_WARMUP_1),
                    **{f"fp8_l4_taylorseer_blocks_warmup1_{intervals}": Setting("fp8_l4", cache)
                       for intervals, cache in TAYLORSEER_BLOCKS_WARMUP_1.items()},
                    **{f"fp8_l4_taylorseer_blocks_warmup1_order2_{intervals}": Setting("fp8_l4", cache)
                       for intervals, cache in TAYLORSEER_BLOCKS_WARMUP_1_ORDER_2.items()},
                    **{f"fp8_l4_first_block{percent}": Setting("fp8_l4", cache) for percent, cache in FIRST_BLOCK.items()},
                    **{name: Setting(name) for name in ("fp8_l4_keep12", "fp8_l4_keep02", "fp8_l4_keep01",
                                                          "fp8_l4_keep_none")},
                    "fp8_l4_keep_none_taylorseer_blocks2_warmup1": Setting("fp8_l4_keep_none",
                                                                           TAYLORSEER_BLOCKS_2_WARMUP_1),
                    "fp8_l4_keep_none_first_block20": Setting("fp8_l4_keep_none", FIRST_BLOCK[20]),
                    **{f"fp8_l4_first_block{high}_low{low}": Setting("fp8_l4", cache)
                       for (high, low), cache in FIRST_BLOCK_PER_EXPERT.items()},
                    "fp16_window1": Setting(None, window=WINDOW_1),
                    "fp8_l4_window1": Setting("fp8_l4", window=WINDOW_1),
                    "fp8_l4_window2": Setting("fp8_l4", window=WINDOW_2),
                    "fp8_l4_window1_low_noise": Setting("fp8_l4", window=WINDOW_1_LOW_NOISE),
                    "fp8_l4_window1_block0_dense": Setting("fp8_l4", window=WINDOW_1_BLOCK_0_DENSE),
                    **{f"fp8_l4_window1_heads{percent}": Setting("fp8_l4", window=window)
                       for percent, window in WINDOW_1_HEADS.items()},
                    **{f"fp8_l4_window1_heads{percent}_taylorseer_blocks2_warmup1":
                       Setting("fp8_l4", TAYLORSEER_BLOCKS_2_WARMUP_1, WINDOW_1_HEADS[percent]) for percent in (90, 85)},
                    **{f"fp8_l4_window1_heads90_first_block{percent}":
                       Setting("fp8_l4", FIRST_BLOCK[percent], WINDOW_1_HEADS[90]) for percent in (15, 20)},
                    "fp8_l4_window1_heads90_first_block20_low25": Setting("fp8_l4", FIRST_BLOCK_PER_EXPERT[20, 25],
                                                                          WINDOW_1_HEADS[90]),
                    **{f"fp8_l4_window1_heads90_first_block_steps_{name}":
                       Setting("fp8_l4", first_block_on_steps(*steps), WINDOW_1_HEADS[90])
                       for name, steps in FIRST_BLOCK_STEPS.items()}},
}
# Points of adherence a setting may lose against the model it is held to: two-object adherence for
# an image model, adherence over all prompts (every attribute and the motion right) for a video one.
WITHIN = 3.0
FIRST_SEED = 42

@dataclass(frozen=True)
class Figure:
    """Where a report holds a figure, what it is multiplied by for the table, and its unit."""

    source: str            # "adherence" (its mean), "temporal" (its temporal means) or "psnr"
    key: str | None
    scale: float = 1.0
    unit: str = ""
    worse_by: float | None = None   # a temporal figure's bound: how far past the unquantized model's it may go
    higher_is_better: bool = True


FIGURES = {"two objects": Figure("adherence", "two_objects", 100, "%"), "all prompts": Figure("adherence", "all", 100, "%"),
           "PSNR": Figure("psnr", None, unit=" dB")}
# A video model's temporal figures besides (clips.score): clips whose objects keep colour and shape in
# every frame, the tracks' largest stray from a straight line (pixels), and the background's change
# from frame to frame (0-255 levels).
# Each 8-bit setting's bound against the unquantized model: identity kept as adherence (3 points);
# jitter half a pixel more, under the detector's one-pixel centroid steps on 64x64 frames; flicker one
# level of 255 more, below what an eye sees between frames.
TEMPORAL_FIGURES = {"identity kept": Figure("temporal", "identity_kept", 100, "%", worse_by=WITHIN),
                    "jitter (px)": Figure("temporal", "jitter", worse_by=0.5, higher_is_better=False),
                    "flicker": Figure("temporal", "flicker", worse_by=1.0, higher_is_better=False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="scenes_sdxl")
    parser.add_argument("--backbone", choices=sorted(SETTINGS), help="default: unet for scenes_sdxl, else transformer")
    parser.add_argument("--settings", help="which settings, by name (default: all of the backbone's)")
    parser.add_argument("--calibrations", type=int, default=3)
    parser.add_argument("--calib-size", type=int, default=32, help="captions per calibration")
    parser.add_argument("--calib-batch", type=int, default=1, help="prompts per calibration batch")
    parser.add_argument("--work", default=".scratch/quality_over_calibrations", help="checkpoints and reports")
    parser.add_argument("--prompts-file", help="default: the shipped model's held-out prompts")
    parser.add_argument("--device", default="cpu")
    add_kernels_argument(parser)
    parser.add_argument("--name", help="the results' name (default quality_means_<model>_<device>[_<kernels>])")
    args = parser.parse_args()
    register_schemas()
    settings = chosen_settings(args)
    variants, caches, windows = calibrated_variants(args, settings)
    name = args.name or f"quality_means_{args.model}_{args.device}" + ("" if args.kernels == "fake" else f"_{args.kernels}")
    report = evaluate_into_results(name, Path(args.work) / "report", [
        f"model={args.model}", f"device={args.device}", f"sampling.prompts_file={held_out_file(args)}",
        "sampling.steps=20", f"torch_backend.quantized={args.kernels}",
        *[f"+variants.{variant}={folder or 'null'}" for variant, folder in variants.items()],
        *per_variant("variant_cache", caches), *per_variant("variant_window", windows)])
    summary = summarized(report, settings, args)
    (RESULTS / f"{name}_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (RESULTS / f"{name}_summary.md").write_text(summary_markdown(summary))
    print(summary_markdown(summary))


def chosen_settings(args) -> dict:
    args.backbone = args.backbone or ("unet" if args.model == "scenes_sdxl" else "transformer")
    table = SETTINGS[args.backbone]
    names = args.settings.split(",") if args.settings else list(table)
    unknown = [name for name in names if name not in table]
    if unknown:
        raise SystemExit(f"--settings: {', '.join(unknown)} not among the {args.backbone} settings ({', '.join(table)})")
    return {name: table[name] for name in names}


def calibration_prompts(args, index: int) -> Path:
    """Calibration `index`'s own slice of the model's calibration captions, as a prompts file."""
    captions = [line for line in (Path(shipped_model_folder(args.model)) / "calib_prompts.txt").read_text().splitlines()
                if line.strip()]
    chosen = captions[index * args.calib_size:(index + 1) * args.calib_size]
    if len(chosen) < args.calib_size:
        raise SystemExit(f"--calibrations {args.calibrations} x --calib-size {args.calib_size} needs more than the "
                         f"model's {len(captions)} captions")
    path = Path(args.work) / f"calib_prompts_{index}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(chosen) + "\n")
    return path


def variant_name(setting: str, index: int | None) -> str:
    return setting if index is None else f"{setting}_c{index}"


def per_variant(key: str, values: dict) -> list[str]:
    """evaluate.py's override giving each variant named in `values` its own value of `key`."""
    return ["+" + key + "={" + ",".join(f"{variant}:{value}" for variant, value in values.items()) + "}"] if values else []


def calibrated_variants(args, settings: dict) -> tuple[dict, dict, dict]:
    """Every setting's evaluate.py variants (name -> checkpoint folder, None for the 16-bit backbone),
    one per calibration for the quantized ones; the cache of the cached ones and the attention
    window of the windowed ones."""
    recipes = dict.fromkeys(setting.recipe for setting in settings.values() if setting.recipe)
    variants, caches, windows = {}, {}, {}

    def add(variant: str, folder, setting: Setting) -> None:
        variants[variant] = folder
        if setting.cache:
            caches[variant] = setting.cache
        if setting.window:
            windows[variant] = setting.window

    for name, setting in settings.items():
        if setting.recipe is None:
            add(name, None, setting)
    for index in range(args.calibrations):
        overrides = [f"prompts_file={calibration_prompts(args, index)}", f"seed={FIRST_SEED + index}",
                     f"quantize.calib_size={args.calib_size}"]
        folders = calibrated(args, {recipe: RECIPES[recipe] + overrides for recipe in recipes})
        for name, setting in settings.items():
            if setting.recipe is not None:
                add(variant_name(name, index), folders[setting.recipe], setting)
    return variants, caches, windows


def figures_of(report: dict) -> dict:
    """The figures a report gives: a video model's temporal ones besides the adherence and PSNR."""
    return FIGURES | (TEMPORAL_FIGURES if "temporal" in report["adherence"][report["reference"]["name"]] else {})


def figure(report: dict, variant: str, figure_name: str) -> float:
    """Two-object or all-prompt adherence in percent, the mean PSNR in dB, or a temporal figure of one
    variant (the reference itself where `variant` is its name)."""
    shown = figures_of(report)[figure_name]
    if shown.source == "psnr":
        return report["variants"][variant]["mean"]["psnr"]
    return shown.scale * report["adherence"][variant][{"adherence": "mean"}.get(shown.source, shown.source)][shown.key]


def summarized(report: dict, settings: dict, args) -> dict:
    """Per setting, each figure's values over the calibrations with their mean and range, and the
    mean's distance to the model it is held to (the unquantized backbone, uncached)."""
    reference = report["reference"]["name"]
    figures = figures_of(report)
    judged = "all prompts" if "identity kept" in figures else "two objects"
    unquantized = {name: figure(report, reference, name) for name, shown in figures.items() if shown.source != "psnr"}
    rows = {}
    for setting, chosen in settings.items():
        recipe = chosen.recipe
        runs = [variant_name(setting, index if recipe else None) for index in range(args.calibrations if recipe else 1)]
        row = {}
        for figure_name in figures:
            values = [figure(report, run, figure_name) for run in runs]
            row[figure_name] = {"values": values, "mean": statistics.fmean(values), "low": min(values),
                                "high": max(values)}
        row[f"{judged} against unquantized"] = row[judged]["mean"] - unquantized[judged]
        row["within"] = row[f"{judged} against unquantized"] >= -WITHIN
        bounded = {name: shown for name, shown in figures.items() if shown.worse_by is not None}
        if bounded:
            row["temporal within"] = all(temporal_within(shown, row[name]["mean"], unquantized[name])
                                         for name, shown in bounded.items())
        rows[setting] = row
    return {"model": args.model, "device": report["settings"]["device"], "kernels": args.kernels,
            "calibrations": args.calibrations, "calib_size": args.calib_size, "reference": reference,
            "judged": judged, "unquantized": unquantized, "prompts": report["adherence"][reference]["scored"],
            "settings": rows}


def temporal_within(shown: Figure, mean: float, unquantized: float) -> bool:
    """Whether a setting's mean temporal figure is no further past the unquantized model's than its bound."""
    worse = unquantized - mean if shown.higher_is_better else mean - unquantized
    return worse <= shown.worse_by


def summary_markdown(summary: dict) -> str:
    unquantized, judged = summary["unquantized"], summary.get("judged", "two objects")
    first = next(iter(summary["settings"].values()))
    names = [name for name in FIGURES | TEMPORAL_FIGURES if name in first]
    # A peer's dynamic quantization (peer_quality.py) calibrates nothing: one run.
    size = summary["calib_size"]
    calibrations = (f"calibration k: captions {size}k to {size}(k+1), seed {FIRST_SEED}+k" if size
                    else "nothing calibrated, one run")
    lines = [f"# Quality over {summary['calibrations']} calibrations: {summary['model']}" if size
             else f"# Quality: {summary['model']}", "",
             f"{summary['device']}, checkpoints run as {summary['kernels']}, {summary['prompts']} held-out prompts; "
             f"{calibrations}. Unquantized ({summary['reference']}): "
             + ", ".join(f"{name} {value:.1f}{(FIGURES | TEMPORAL_FIGURES)[name].unit}" for name, value in unquantized.items())
             + (". Each cell: the mean over the calibrations, then its lowest and highest" if size
                else ". Each cell: the run's figure") + "; a setting is within "
             f"target where its mean {judged} adherence is at most {WITHIN:g} points under the unquantized model's"
             + ("; temporally within where no mean temporal figure is further past the unquantized model's than "
                + ", ".join(f"{name} {shown.worse_by:g}" for name, shown in TEMPORAL_FIGURES.items())
                if "temporal within" in first else "") + ".",
             "", "| setting | " + " | ".join(f"{name} ({FIGURES['PSNR'].unit.strip()})" if name == "PSNR" else name
                                            for name in names)
             + " | against unquantized | within |" + (" temporally within |" if "temporal within" in first else ""),
             "| --- " * (len(names) + 3 + ("temporal within" in first)) + "|"]
    for setting, row in summary["settings"].items():
        cells = [f"{row[name]['mean']:.1f}" + (f" ({row[name]['low']:.1f}-{row[name]['high']:.1f})" if size else "")
                 for name in names]
        lines.append(f"| {setting} | " + " | ".join(cells)
                     + f" | {row[f'{judged} against unquantized']:+.1f} | {'yes' if row['within'] else 'no'} |"
                     + (f" {'yes' if row['temporal within'] else 'no'} |" if "temporal within" in row else ""))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
