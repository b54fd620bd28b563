#!/usr/bin/env bash
# Installs sdquant on a machine that has its own torch and no network (the GPU machines): pip
# resolves sdquant's dependencies against what is installed, offline, from the wheels that
# tools/maintainer/fetch_wheels.py put in .whl/, then this checks that pip kept the machine's torch
# and added no broken requirement. Every GPU benchmark starts with it. With `tiny`, it then runs the
# tiny workflow there: quantize.py, then infer_trt.py backend=torch with the quantized UNet (its
# first call on a GPU builds ModelOpt's CUDA extension). With `extensions`, it builds ModelOpt's
# CUDA extensions (fake quantization in INT8 and FP8) before any test needs them: a test stopped by
# a timeout while its first call builds one leaves torch's build lock behind, and every later
# build on that machine then waits on the lock for ever.
#   bash tools/maintainer/gpu_install.sh [tiny|extensions]          (carry .whl)
# Logs, the image's package list and the results go to $OUT (./gpu_install_out when unset).
# PYTHON (default python3) and DEVICE (default cuda) let it be tried elsewhere.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(realpath -m "${OUT:-gpu_install_out}")
mkdir -p "$out"
python=${PYTHON:-python3}
exec > >(tee "$out/gpu_install.log") 2>&1
torch_version() { "$python" -c "from importlib.metadata import version; print(version('torch'))"; }

"$python" -m pip list --format=freeze > "$out/gpu_image_freeze.txt"
"$python" -m pip check > "$out/pip_check_before.txt" || true
before=$(torch_version)
"$python" -m pip install --no-index --find-links .whl --no-compile -e .
after=$(torch_version)
if [ "$before" != "$after" ]; then
    echo "gpu_install: pip replaced torch $before with $after" >&2
    exit 1
fi
# The image's own broken requirements, if any, are not sdquant's doing: only new ones fail.
"$python" -m pip check > "$out/pip_check_after.txt" || true
if new=$(grep -vxF -f "$out/pip_check_before.txt" "$out/pip_check_after.txt" | grep -v "^No broken"); then
    echo "gpu_install: pip check found what the install broke:" >&2
    echo "$new" >&2
    exit 1
fi
echo "gpu_install: sdquant $("$python" -c 'import sdquant; print(sdquant.__version__)') installed; torch $after kept;" \
     "pip check: $(cat "$out/pip_check_after.txt")"
# Wheels fetched without their dependencies (fetch_wheels.py --alone), after the checks: pip check
# would rightly name what they leave out (nvidia-cutlass-dsl, which the device tool cannot carry).
if compgen -G ".whl/alone/*.whl" > /dev/null; then
    "$python" -m pip install --no-index --no-deps --no-compile .whl/alone/*.whl
    echo "gpu_install: installed without their dependencies: $(cd .whl/alone && ls *.whl | tr '\n' ' ')"
fi

if [ "${1:-}" = extensions ]; then
    "$python" -c "from modelopt.torch.quantization import extensions as e
assert e.get_cuda_ext() is not None and e.get_cuda_ext_fp8() is not None, 'a ModelOpt CUDA extension did not build'"
    echo "gpu_install: ModelOpt's CUDA extensions built"
fi

if [ "${1:-}" = tiny ]; then
    device=${DEVICE:-cuda}
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    export SDQUANT_CACHE="$work/cache"
    "$python" quantize.py model=tiny_sdxl quantize.quant_level=3 quantize.n_steps=4 quantize.calib_size=4 \
        device="$device" out_dir="$work/quantized" hydra.run.dir="$work/hydra/quantize"
    checkpoint=$(ls -d "$work"/quantized/nemo_tiny_sdxl_int8_l3_*)
    "$python" infer_trt.py model=tiny_sdxl backend=torch quantized_unet="$checkpoint" device="$device" \
        sampling.width=64 sampling.height=64 sampling.steps=4 out_path="$work/images" \
        hydra.run.dir="$work/hydra/infer"
    cp "$checkpoint"/*.json "$work"/images/latency.json "$work"/images/*.png "$out"/
    echo "gpu_install: tiny workflow ran on $device"
fi
