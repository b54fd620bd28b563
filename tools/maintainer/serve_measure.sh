#!/usr/bin/env bash
# The serving figures of docs/serving.md on one GPU, at full size on random weights (speed only:
# the images are noise): the family's architecture as a folder (benchmarks/full_size_folder.py), a
# quick FP8 calibration of it (quantize.py; its ranges do not change the speed), then one
# serve_load.py command that starts serve.py, runs LoadGen's Offline and then Server, and stops it.
#   bash tools/maintainer/serve_measure.sh sdxl|flux [prepare]
# `prepare` writes the folder and the checkpoint only (before Ray is installed, say); a later run
# without it reuses both.
# after gpu_install.sh and `pip install -e ".[serve,serve-load]"` (Ray's wheel: fetch_wheels.py).
# Results: benchmarks/results/serve_<model>_server_<gpu>.json, rewritten after each LoadGen run; the
# folder and the checkpoint stay under WORK/<family> (WORK: /tmp/serve_measure) for a second run.
set -euo pipefail
cd "$(dirname "$0")/../.."
family=${1:-}
work=${WORK:-/tmp/serve_measure}/$family
case "$family" in
sdxl)
    model=sdxl_base level=3 calibration="quantize.calib_size=2 quantize.n_steps=4"
    # Calls padded to 8 images, the one batch compiled: near MLPerf's rate calls are nearly full,
    # and each other warmed batch costs minutes of compiling before the server is ready.
    serving="sampling.steps=20 serve.max_batch_size=8 serve.warm_batches=[]"
    load="--search --search-low 0.9 --search-steps 1 --expected-qps 2.5"
    ;;
flux)
    model=flux_dev level=4 calibration="quantize.calib_size=1 quantize.n_steps=2"
    # One image a call, as the Flux headline rows, on the attention kernel pip installs.
    serving="sampling.steps=28 serve.max_batch_size=1 serve.max_images_per_request=1 torch_backend.attention_kernel=torch"
    load="--target-share 0.8 --expected-qps 0.5 --min-queries 32"
    ;;
*)
    echo "serve_measure.sh: give sdxl or flux, not '$family'" >&2
    exit 2
    ;;
esac
folder=$work/full
[ -d "$folder" ] || python3 benchmarks/full_size_folder.py --family "$family" --out "$folder"
checkpoint() { ls -d "$work"/quantized/*_fp8_l${level}_* 2>/dev/null | head -1; }
[ -n "$(checkpoint)" ] || python3 quantize.py model=$model model.source="$folder" quantize.format=fp8 \
    quantize.quant_level=$level $calibration out_dir="$work/quantized" hydra.run.dir="$work/hydra/quantize"
[ "${2:-}" != prepare ] || exit 0
checkpoint=$(checkpoint)
# shellcheck disable=SC2086  # $load is several arguments
python3 benchmarks/serve_load.py --scenario server $load --min-duration-s 120 --model $model \
    --serve "model=$model model.source=$folder backend=torch quantized_backbone=$checkpoint \
torch_backend.quantized=fp8 torch_backend.compile=true cuda_graph=true $serving hydra.run.dir=$work/hydra/serve"
