#!/usr/bin/env bash
# Builds a wheel of FlashAttention-3 (flash_attn_3: flash_attn_interface.flash_attn_func) with only
# what the Wan experts' FP8 self-attention needs on Hopper: the forward pass at head_dim 128 in bf16
# and FP8 e4m3, without backward, paged or split KV, varlen, softcap, local or sm80 kernels, so that
# it builds in minutes rather than hours. PyPI has no FA3 for torch 2.11 (its flash-attn-3 is an
# empty, yanked 0.0.0), and the GPU machines reach no network: build where nvcc 13 and PyPI are, or
# on the GPU machine from a carried source tree and its own torch.
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
