#!/usr/bin/env bash
# The whole workflow on a built-in scene model (shipped in the package; no download), writing into
# the current folder: calibrate and quantize the backbone to 8 bits, export ONNX and build
# TensorRT(-RTX) engines, draw two scenes, and compare the 8-bit backbone with the 16-bit one on
# held-out prompts of one and two objects (images, PSNR/SSIM, prompt adherence, grid.png). Images
# are made with the exported graphs in ONNX Runtime, since engines need a GPU they were built for.
#   bash demo_tiny.sh                 # scenes_sdxl
#   bash demo_tiny.sh scenes_flux     # scenes_flux
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
model=${1:-scenes_sdxl}
case "$model" in
    # INT8 at level 3 with NeMo's recipe at its defaults (32 prompts, 20 steps, min-mean Percentile
    # Quant on convolution inputs, SmoothQuant alpha 0.8 on Linear layers); the transformer has no
    # convolutions. INT8, not FP8: ONNX Runtime runs INT8 graphs, FP8 ones only TensorRT.
    scenes_sdxl) backbone=unet_xl ;;
    scenes_flux) backbone=transformer ;;
    *) echo "demo_tiny.sh: the model is scenes_sdxl or scenes_flux, not '$model'" >&2; exit 2 ;;
esac
python "$here/quantize.py" model="$model" quantize.quant_level=3 out_dir=quantized
# The folder is named from the settings and ends in their fingerprint.
checkpoint="$(ls -d "quantized/nemo_${model}_int8_l3_a0.8_min-mean_p1_s20_c32_b1_seed42_"*)"
python "$here/export_trt.py" model="$model" quantized_unet="$checkpoint" infer.width=64 infer.height=64
python "$here/infer_trt.py" model="$model" backend=onnxruntime sampling.width=64 sampling.height=64 sampling.steps=20 \
    'sampling.prompts=["a large purple triangle at the bottom, white background","a small blue circle on the left and a red square on the right, pink background"]'
held_out="$(python -c "from sdquant.config import shipped_model_folder as f; print(f('$model'))")/heldout_prompts.txt"
# The file holds 64 one-object prompts, then 64 two-object ones: eight of each.
{ head -n 8 "$held_out"; sed -n 65,72p "$held_out"; } > prompts.txt
python "$here/evaluate.py" model="$model" +variants.int8="$checkpoint" +variants.int8_onnx="sdxl_export/onnx/$backbone/model.onnx" \
    sampling.prompts_file=prompts.txt sampling.width=64 sampling.height=64 sampling.steps=20 sampling.batch_size=16
