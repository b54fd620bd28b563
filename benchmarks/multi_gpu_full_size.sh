#!/usr/bin/env bash
# Generation spread over the GPUs of one host against one GPU: infer_trt.py backend=torch on the
# full-size SDXL architecture (random fp16 weights) with an FP8 level-3 UNet, compiled, CUDA graphs,
# 1024x1024, 20 steps, 32 prompts a GPU in batches of 8, run three ways: one process on one GPU, torchrun
# over N GPUs (NCCL), and N shard jobs side by side (shard.index/count, as Slurm array tasks run).
# FAMILY=flux runs Flux.1-dev's architecture (random bf16 weights) at FP8 level 4 instead, 28 steps,
# 8 prompts a GPU one at a time.
# Target: at least 1.9x one GPU's images/s on 2 GPUs, 3.7x on 4. The N-GPU runs must draw
# the images of the one-GPU run: the report gives each file's pixel difference, and asserts nothing.
#   bash benchmarks/multi_gpu_full_size.sh OUT.json [GPUS] [--deepcache]   (GPUS: all visible)
# --deepcache (or DEEPCACHE=1) runs the three again with DeepCache every 2 steps. Run it after
# tools/maintainer/gpu_install.sh; on 2 GPUs it takes about 10 minutes (three compiles of the full UNet).
# Test mode, small, for a CPU: SIZE=tiny DEVICE=cpu GPUS=2 PROMPTS=16 runs the same steps on the
# tiny model at 64x64, 2 steps, without compile or CUDA graphs (torchrun over gloo, the shard jobs
# as CPU processes side by side). WORK=<folder> keeps the models, images and logs there.
set -euo pipefail
args=()
deepcache=${DEEPCACHE:-0}
for arg in "$@"; do
    if [ "$arg" = --deepcache ]; then deepcache=1; else args+=("$arg"); fi
done
out=$(realpath -m "${args[0]:?usage: multi_gpu_full_size.sh OUT.json [GPUS] [--deepcache]}")
cd "$(dirname "$0")/.."
# The GPUs this may use: CUDA_VISIBLE_DEVICES where set (each job below picks one of them by it).
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then IFS=, read -ra visible <<< "$CUDA_VISIBLE_DEVICES"
elif command -v nvidia-smi > /dev/null; then mapfile -t visible < <(nvidia-smi --query-gpu=index --format=csv,noheader)
else visible=(0 1 2 3 4 5 6 7); fi
gpus=${args[1]:-${GPUS:-${#visible[@]}}}
if [ "$gpus" -lt 2 ]; then
    echo "multi_gpu_full_size: $gpus GPU(s) visible; it compares one GPU with several: give GPUS=2 or more" >&2
    exit 1
fi
size=${SIZE:-full}
device=${DEVICE:-cuda}
family=${FAMILY:-sdxl}
# Per family: the config, the class that builds its architecture, the quant level, images a batch,
# batches a GPU (the rate after each process's first batch then counts the others) and steps.
case "$family" in
sdxl) config=sdxl_base family_class=sd:SDXL level=3 batch=8 batches=4 full_steps=20 ;;
flux) config=flux_dev family_class=flux:FLUX level=4 batch=1 batches=8 full_steps=28 ;;
*) echo "multi_gpu_full_size: FAMILY=$family: give sdxl or flux" >&2; exit 1 ;;
esac
if [ "$deepcache" = 1 ] && [ "$family" != sdxl ]; then
    echo "multi_gpu_full_size: --deepcache is SDXL's cache: leave it out with FAMILY=$family" >&2
    exit 1
fi
prompts=${PROMPTS:-$((batch * batches * gpus))}
if [ "$size" = tiny ]; then pixels=64 steps=2; else pixels=1024 steps=$full_steps; fi
# torch.compile and CUDA graphs are what a GPU user runs; on a CPU they would only cost time.
if [ "$device" = cpu ]; then fast=false; else fast=true; fi
if [ -n "${WORK:-}" ]; then
    work=$(realpath -m "$WORK")
    mkdir -p "$work"
else
    work=$(mktemp -d)
    # The full-size SDXL is 7 GB, Flux 33, and every run writes its images: none of it outlives the report.
    trap 'rm -rf "$work"' EXIT
fi
# A WORK folder kept from an earlier run: its shard reports would be merged into this run's.
rm -rf "$work/model" "$work/quantized" "$work/out" "$work/wall" "$work/logs"
mkdir -p "$work/wall" "$work/logs"

# 1. The model as a diffusers folder, saved without a variant: load.py reads a local folder without
# model.variant, so files named *.fp16.safetensors would not be found (the weights are 16-bit anyway).
python3 - "$work/model" "$size" "$family_class" <<'PY'
import importlib
import sys
from sdquant.families.base import full_size_on_gpu
folder, size, family_class = sys.argv[1:]
module, name = family_class.split(":")
family = getattr(importlib.import_module(f"sdquant.families.{module}"), name)
pipe = full_size_on_gpu(family) if size == "full" else family.build_pipeline(family.sizes["tiny"])
pipe.save_pretrained(folder)
PY
model=(model=$config model.source="$work/model" device="$device")

# 2. Its FP8 checkpoint from the fewest prompts and steps quantize.py takes: the kernels' speed does
# not depend on the ranges, and one backbone call already gives every quantizer its range.
python3 quantize.py "${model[@]}" quantize.format=fp8 quantize.quant_level=$level quantize.calib_size=1 \
    quantize.n_steps=1 quantize.batch_size=1 out_dir="$work/quantized" hydra.run.dir="$work/hydra/quantize"
checkpoint=$(ls -d "$work"/quantized/nemo_${config}_fp8_l${level}_*)

# 3. Distinct prompts, so that a batch drawn on the wrong GPU or twice shows in the comparison.
for style in "a photo" "an oil painting" "a pencil sketch" "a watercolour"; do
    for subject in "a red fox" "an old lighthouse" "a bowl of ramen" "a vintage car" "a snowy owl" \
                   "a sailing ship" "a cup of coffee" "a mountain cabin"; do
        for place in "at dawn" "in the rain" "under neon lights" "in a forest" "on a beach" "in the desert" \
                     "at night" "in autumn"; do
            echo "$style of $subject $place"
        done
    done
done | sed -n "1,${prompts}p" > "$work/prompts.txt"  # sed reads to the end: head would break the pipe

# 4. The runs, each into its own folder; wall-clock seconds include start-up, loading and compiling.
infer=("${model[@]}" backend=torch quantized_unet="$checkpoint" torch_backend.quantized=fp8
       torch_backend.compile=$fast cuda_graph=$fast sampling.prompts_file="$work/prompts.txt"
       sampling.batch_size=$batch sampling.steps=$steps sampling.width=$pixels sampling.height=$pixels num_timed_runs=2)
# NVLink multicast stays off: on shared hosts it can take every GPU of the host out of service, and
# the ranks exchange only their reports.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

run_three() {  # run_three NAME_SUFFIX [override ...]
    local suffix=$1 name start pids=() failed=0
    shift
    name=one$suffix
    start=$(date +%s.%N)
    CUDA_VISIBLE_DEVICES=${visible[0]} python3 infer_trt.py "${infer[@]}" "$@" out_path="$work/out/$name" \
        hydra.run.dir="$work/hydra/$name"
    echo "$start $(date +%s.%N)" > "$work/wall/$name"

    name=torchrun$suffix
    start=$(date +%s.%N)
    python3 -m torch.distributed.run --standalone --nproc_per_node="$gpus" infer_trt.py "${infer[@]}" "$@" \
        out_path="$work/out/$name" hydra.run.dir="$work/hydra/$name"
    echo "$start $(date +%s.%N)" > "$work/wall/$name"

    name=shards$suffix
    start=$(date +%s.%N)
    for ((i = 0; i < gpus; i++)); do
        CUDA_VISIBLE_DEVICES=${visible[$i]} python3 infer_trt.py "${infer[@]}" "$@" shard.index=$i shard.count="$gpus" \
            out_path="$work/out/$name" hydra.run.dir="$work/hydra/$name/$i" > "$work/logs/$name.$i.log" 2>&1 &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    echo "$start $(date +%s.%N)" > "$work/wall/$name"
    # Side by side their output would interleave: each job's, one after another.
    for ((i = 0; i < gpus; i++)); do echo "--- shard $i of $gpus"; cat "$work/logs/$name.$i.log"; done
    [ "$failed" = 0 ]
}

groups=(none)
run_three ""
if [ "$deepcache" = 1 ]; then
    groups+=(deepcache)
    run_three _deepcache sampling.cache.method=deepcache sampling.cache.interval=2
fi

# 5. The report.
python3 - "$work" "$out" "$gpus" "$prompts" "$size" "$device" "$config" "$level" "$batch" "${groups[@]}" <<'PY'
import json, sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from sdquant.report import library_versions

work, out, gpus, prompts, size, device, config, level, batch, *groups = sys.argv[1:]
work, gpus, prompts = Path(work), int(gpus), int(prompts)
TARGETS = {2: 1.9, 4: 3.7}


def run(name):
    latency = json.loads((work / "out" / name / "latency.json").read_text())
    start, end = map(float, (work / "wall" / name).read_text().split())
    # images_per_second: each process's timed runs of its first batch, summed; after_first_batch: the
    # batches after each process's first, saving included, in the slowest process's time.
    parts = latency.get("parts", [latency])
    pngs = len(list((work / "out" / name).glob("*.png")))
    return {"images_per_second": latency["images_per_second"],
            "after_first_batch_images_per_second": latency["after_first_batch"]["images_per_second"],
            "first_call_seconds": latency["first_call_seconds"], "setup_seconds": latency["setup_seconds"],
            "wall_seconds": end - start, "images_written": latency["images_written"], "pngs_on_disk": pngs,
            "parts": len(parts), "shards": latency.get("shards"), "device": latency["device"],
            "images_written_is_sum_of_parts": latency["images_written"] == sum(p["images_written"] for p in parts),
            "images_written_is_every_prompt": latency["images_written"] == prompts}


def ratio(a, b):
    return a / b if a and b else None


def least_pixel_spread(name):
    # Constant images (a NaN in fp16 draws black) would compare equal and prove nothing.
    return min(float(np.asarray(Image.open(p), dtype=np.float32).std()) for p in (work / "out" / name).glob("*.png"))


def same_images(one, other):
    diffs, missing = [], []
    for path in sorted((work / "out" / one).glob("*.png")):
        twin = work / "out" / other / path.name
        if not twin.is_file():
            missing.append(path.name)
            continue
        a, b = (np.asarray(Image.open(p).convert("RGB"), dtype=np.int16) for p in (path, twin))
        diffs.append(int(np.abs(a - b).max()) if a.shape == b.shape else 255)
    return {"compared": len(diffs), "missing": missing, "max_abs_pixel_difference": max(diffs, default=None),
            "files_differing": sum(d > 0 for d in diffs)}


report = {"benchmark": "multi_gpu_full_size", "size": size, "gpus": gpus, "visible_gpus": torch.cuda.device_count(),
          "versions": library_versions(),
          "settings": {"model": f"{config} architecture ({size}), random weights, FP8 level {level}, torch backend",
                       "prompts": prompts, "batch_size": int(batch), "compile_and_cuda_graph": device != "cpu"},
          "target_scaling": TARGETS.get(gpus)}
for group in groups:
    suffix = "" if group == "none" else f"_{group}"
    runs = {way: run(way + suffix) for way in ("one", "torchrun", "shards")}
    report.setdefault("device", runs["one"]["device"])
    scaling = {way: runs[way]["images_per_second"] / runs["one"]["images_per_second"] for way in ("torchrun", "shards")}
    report[f"cache_{group}"] = {
        "runs": runs, "scaling": scaling,
        # None where a process had only one batch (its first, which compiles, is not counted).
        "after_first_batch_scaling": {way: ratio(runs[way]["after_first_batch_images_per_second"],
                                           runs["one"]["after_first_batch_images_per_second"]) for way in ("torchrun", "shards")},
        "meets_target": {way: value >= TARGETS[gpus] for way, value in scaling.items()} if gpus in TARGETS else None,
        "same_images_as_one": {way: same_images("one" + suffix, way + suffix) for way in ("torchrun", "shards")},
        "least_pixel_std_of_one": least_pixel_spread("one" + suffix)}
print(json.dumps(report, indent=2))
Path(out).parent.mkdir(parents=True, exist_ok=True)
Path(out).write_text(json.dumps(report, indent=2) + "\n")
PY
