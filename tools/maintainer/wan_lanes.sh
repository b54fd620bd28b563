#!/usr/bin/env bash
# Runs benchmarks/wan_full_size.py's rows on one host of 4 GPUs, in the background from a
# copy of the tree (the device tool lays the tree anew on each call), so that they outlast a call's
# ten minutes while later calls look at them. One GPU a lane first: ours and the peer in bf16 with
# their kernel profiles; FP8 level 4 with every block quantized (the ceiling) and the TI2V-5B's
# bf16 against its peer; on the other two GPUs the 2-GPU splits (cfg 2, then ulysses 2). Then four
# processes side by side (data parallel), whose whole calls are also the one-GPU step of the same
# host. Results in /tmp/wan/results (file names end in TAG, the device: h200 unless given), logs in /tmp/wan.
# Every lane runs the default attention kernels: FlashAttention-3 where its wheel (benchmarks/build_flash3.sh)
# is installed, else torch's (the rows' attention_kernel says which).
#   bash tools/maintainer/wan_lanes.sh start      (from the tree, once sdquant's wheels are installed)
#   bash tools/maintainer/wan_lanes.sh status     (each log's tail)
#   bash tools/maintainer/wan_lanes.sh collect    (results and logs into $OUT)
set -uo pipefail
root=/tmp/wan
results=$root/results
bench="python3 benchmarks/wan_full_size.py"
torchrun="python3 -m torch.distributed.run --standalone"

lane() {  # lane <name> <gpus> <command>...: the commands one after another on those GPUs
    local name=$1 gpus=$2
    shift 2
    (
        export CUDA_VISIBLE_DEVICES=$gpus
        for command in "$@"; do
            echo "$(date +%T) start: $command"
            bash -c "$command"
            code=$?  # read before the echo: its $(date) would reset $?
            echo "$(date +%T) exit $code"
        done
    ) >> "$root/$name.log" 2>&1
}

phases() {
    cd "$root/tree"
    # The tree's sdquant, then what the install put beside the image's packages (/tmp/site).
    export PYTHONPATH=$root/tree:/tmp/site
    lane one_gpu_0 0 "$bench --variants compiled,peer --profile --calls 3 --out $results/wan_a14b_bf16_peer_profiles_$tag.json" &
    lane one_gpu_1 1 "$bench --variants fp8_l4 --every-block --out $results/wan_a14b_fp8_l4_every_block_$tag.json" \
        "$bench --model wan_ti2v --variants compiled,peer --calls 4 --out $results/wan_ti2v_5b_bf16_peer_$tag.json" &
    lane two_gpus 2,3 "$torchrun --nproc_per_node=2 benchmarks/wan_full_size.py --variants fp8_l4 --split 2x1 --out $results/wan_split_2gpus_$tag.json" \
        "$torchrun --nproc_per_node=2 benchmarks/wan_full_size.py --variants fp8_l4 --split 1x2 --out $results/wan_split_2gpus_$tag.json" &
    wait
    lane four_gpus 0,1,2,3 "$torchrun --nproc_per_node=4 benchmarks/wan_full_size.py --variants fp8_l4 --split 1x1 --out $results/wan_data_parallel_${tag}x4.json"
    touch "$root/done"
}

case "${1:-}" in
start)
    rm -rf "$root" && mkdir -p "$results" "$root/tree" && cp -r . "$root/tree"
    export -f lane phases
    export root results bench torchrun tag=${TAG:-h200}
    PYTHONUNBUFFERED=1 setsid nohup bash -c phases > "$root/phases.log" 2>&1 < /dev/null &
    echo "started; logs in $root"
    ;;
status)
    for log in "$root"/*.log; do echo "== $log"; tail -c 1500 "$log"; echo; done
    ls "$results"
    ;;
collect)
    cp "$results"/*.json "$OUT"/ 2>/dev/null
    tar -C "$root" -czf "$OUT/wan_logs.tar.gz" --exclude=tree --exclude=results .
    ls "$OUT"
    ;;
*)
    echo "wan_lanes.sh: start, status or collect, not ${1:-nothing}" >&2
    exit 2
    ;;
esac
