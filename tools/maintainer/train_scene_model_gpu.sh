#!/usr/bin/env bash
# Trains the built-in scene models on the GPU machine, side by side in the background (one GPU each
# in turn), from a copy of the tree outside it (the device tool lays the tree anew on each call),
# one log each in /tmp.
#   bash tools/maintainer/train_scene_model_gpu.sh start "<config-name>:<out_dir> [override ...]" ...   (carry .whl)
# The copy and the install happen once per machine, so a short run can measure the speed first and
# a second `start` launch the real one.
# Then `bash tools/maintainer/train_scene_model_gpu.sh collect <out_dir> ...` waits for each folder and
# puts it into $OUT: its largest weights file alone, the rest as one tar, and its log (the device
# returns 8 files of 16 MiB).
set -euo pipefail
action=$1
shift
if [ "$action" = collect ]; then
    for out in "$@"; do
        name=$(basename "$out")
        while [ ! -f "$out/training.json" ]; do
            if ! pgrep -f "out_dir=$out" > /dev/null; then tail -c 3000 "/tmp/train_$name.log"; exit 1; fi
            sleep 10
        done
        biggest=$(find "$out" -name "*.safetensors" -printf "%s %p\n" | sort -n | tail -1 | cut -d" " -f2)
        cp "$biggest" "$OUT/$name.$(basename "$(dirname "$biggest")").safetensors"
        tar -C "$(dirname "$out")" --exclude="${biggest#$(dirname "$out")/}" -cf "$OUT/$name.tar" "$name"
        cp "/tmp/train_$name.log" "$OUT/train_$name.log"
    done
    exit 0
fi
bash "$(dirname "$0")/gpu_queue.sh" install
cd /tmp/w
# One job a GPU where the host has several (a 4-GPU host trains four recipes side by side).
gpus=$(nvidia-smi -L | wc -l)
n=0
for job in "$@"; do
    read -r spec overrides <<< "$job"
    config=${spec%%:*} out=${spec#*:}
    gpu=$((n % gpus))
    n=$((n + 1))
    # shellcheck disable=SC2086  # the overrides are words for Hydra
    CUDA_VISIBLE_DEVICES=$gpu setsid nohup python3 tools/train_scene_model.py --config-name "$config" out_dir="$out" \
        $overrides hydra.run.dir="/tmp/hydra_$(basename "$out")" > "/tmp/train_$(basename "$out").log" 2>&1 < /dev/null &
    echo "training $config into $out on GPU $gpu in the background (log /tmp/train_$(basename "$out").log)"
done
