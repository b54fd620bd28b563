#!/usr/bin/env bash
# The whole workflow on a built-in scene model (shipped in the package; no download), writing into
# the current folder: calibrate and quantize the backbone to 8 bits, export ONNX and build
# TensorRT(-RTX) engines, draw two scenes (or clips), and compare the 8-bit backbone with the 16-bit
# one on held-out prompts of one and two objects (images or frames, PSNR/SSIM, prompt adherence, for
# clips the direction and speed of motion too, grid.png). Samples are made with the exported graphs
# in ONNX Runtime, since engines need a GPU they were built for.
#   bash demo_tiny.sh                 # scenes_sdxl
#   bash demo_tiny.sh scenes_flux     # scenes_flux
#   bash demo_tiny.sh scenes_wan      # scenes_wan: clips of moving shapes, two experts
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
model=${1:-scenes_sdxl}
# INT8 at level 3 with NeMo's recipe at its defaults (32 prompts, 20 steps, min-mean Percentile
# Quant on convolution inputs, SmoothQuant alpha 0.8 on Linear layers); the transformers have no
# convolutions. INT8, not FP8: ONNX Runtime runs INT8 graphs, FP8 ones only TensorRT.
images=("a large purple triangle at the bottom, white background"
        "a small blue circle on the left and a red square on the right, pink background")
export_batch=()
case "$model" in
    scenes_sdxl) backbone=unet_xl prompts=("${images[@]}") ;;
    scenes_flux) backbone=transformer prompts=("${images[@]}") ;;
    # Two experts are two graphs, and evaluate.py takes one graph as a variant: the checkpoint,
    # which holds both, is the variant. The video graphs are traced at one batch: a video a call.
    scenes_wan) backbone="" export_batch=(infer.batch_size=1) prompts=("a purple triangle moving quickly from top to bottom, white background"
        "a red circle at the top moving from left to right and a blue square at the bottom moving from right to left, pink background") ;;
    *) echo "demo_tiny.sh: the model is scenes_sdxl, scenes_flux or scenes_wan, not '$model'" >&2; exit 2 ;;
esac
folder="$(python -c "from sdquant.config import shipped_model_folder as f; print(f('$model'))")"
python "$here/quantize.py" model="$model" quantize.quant_level=3 out_dir=quantized
# The folder is named from the settings and ends in their fingerprint.
checkpoint="$(ls -d "quantized/nemo_${model}_int8_l3_a0.8_min-mean_p1_s20_c32_b1_seed42_"*)"
python "$here/export_trt.py" model="$model" quantized_unet="$checkpoint" infer.width=64 infer.height=64 ${export_batch[@]+"${export_batch[@]}"}
quoted=$(printf '"%s",' "${prompts[@]}")
python "$here/infer_trt.py" model="$model" backend=onnxruntime sampling.width=64 sampling.height=64 sampling.steps=20 \
    "sampling.prompts=[${quoted%,}]"
held_out="$folder/heldout_prompts.txt"
# The file holds 64 one-object prompts, then 64 two-object ones: eight of each.
{ head -n 8 "$held_out"; sed -n 65,72p "$held_out"; } > prompts.txt
onnx_variant=()
if [ -n "$backbone" ]; then onnx_variant=("+variants.int8_onnx=sdxl_export/onnx/$backbone/model.onnx"); fi
python "$here/evaluate.py" model="$model" +variants.int8="$checkpoint" ${onnx_variant[@]+"${onnx_variant[@]}"} \
    sampling.prompts_file=prompts.txt sampling.width=64 sampling.height=64 sampling.steps=20 sampling.batch_size=16
