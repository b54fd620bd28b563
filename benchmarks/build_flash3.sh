#!/usr/bin/env bash
# The fallback where fa3-fwd (PyPI, in the fp8-attention extra) does not install: builds a wheel of
# FlashAttention-3 (flash_attn_3: flash_attn_interface.flash_attn_func) with only what the Wan
# experts' FP8 self-attention needs on Hopper: the forward pass at head_dim 128 in bf16 and FP8
# e4m3, without backward, paged or split KV, varlen, softcap, local or sm80 kernels, so that it
# builds in minutes rather than hours. Build where nvcc 13 is, or on the GPU machine from a carried
# source tree and its own torch. The tree is flash-attention at FLASH_ATTENTION_COMMIT, the commit
# whose wheel fa3-fwd's speed and outputs were checked against (fp8_attention_plans.py); another
# is refused unless ANY_COMMIT=1.
#   bash benchmarks/build_flash3.sh SRC OUT
# SRC: a flash-attention source tree with hopper/ and csrc/cutlass/include (CUTLASS at the commit
# flash-attention pins), e.g. from git archive of both repositories. OUT: where the wheel goes.
# PYTHON: a Python with the target machine's torch (default python3); CUDA_HOME: nvcc's CUDA
# (default /usr/local/cuda). MAX_JOBS: parallel compiles (default: the cores).
#   python benchmarks/fp8_attention_plans.py --out ...   (then times it beside cuDNN's)
set -euo pipefail
src=$(realpath "${1:?usage: build_flash3.sh SRC OUT}")
out=$(realpath -m "${2:?usage: build_flash3.sh SRC OUT}")
python=${PYTHON:-python3}
for need in "$src/hopper/setup.py" "$src/csrc/cutlass/include/cute"; do
    [ -e "$need" ] || { echo "build_flash3: $need is missing: give a flash-attention tree with CUTLASS's include" >&2; exit 1; }
done
FLASH_ATTENTION_COMMIT=0251105a
if [ -z "${ANY_COMMIT:-}" ] && [ -d "$src/.git" ]; then
    head=$(git -C "$src" rev-parse HEAD)
    case "$head" in
        "$FLASH_ATTENTION_COMMIT"*) ;;
        *) echo "build_flash3: $src is at $head, not flash-attention $FLASH_ATTENTION_COMMIT: check it out, or set ANY_COMMIT=1" >&2
           exit 1 ;;
    esac
fi
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export MAX_JOBS=${MAX_JOBS:-$(nproc)} NVCC_THREADS=1 FLASH_ATTENTION_FORCE_BUILD=TRUE
for feature in BACKWARD SPLIT PAGEDKV APPENDKV LOCAL SOFTCAP PACKGQA FP16 VARLEN CLUSTER HDIM64 HDIM96 HDIM192 \
               HDIM256 SM80 HDIMDIFF64 HDIMDIFF192; do
    export "FLASH_ATTENTION_DISABLE_$feature=TRUE"
done
# setup.py reads the repository's README for the wheel's description.
[ -f "$src/README.md" ] || echo "FlashAttention-3, built by sdquant's build_flash3.sh" > "$src/README.md"
mkdir -p "$out"
start=$SECONDS
(cd "$src/hopper" && "$python" setup.py bdist_wheel --dist-dir "$out")
echo "build_flash3: $(ls "$out"/flash_attn_3-*.whl) in $((SECONDS - start)) s"
