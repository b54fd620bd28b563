#!/usr/bin/env bash
# The whole workflow on the tiny built-in SDXL (no download), writing into the current folder:
# calibrate and quantize the UNet to INT8, export ONNX and build TensorRT(-RTX) engines, then
# generate an image and compare the quantized UNet with the fp16 one. Images are made with the
# exported graphs in ONNX Runtime, since engines need a GPU they were built for.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python "$here/quantize.py" model=tiny_sdxl quantize.quant_level=3 quantize.n_steps=4 quantize.calib_size=4 \
    out_dir=quantized
# The folder is named from the settings and ends in their fingerprint.
checkpoint="$(ls -d quantized/nemo_tiny_sdxl_int8_l3_a0.8_min-mean_p1_s4_c4_b1_seed42_*)"
python "$here/export_trt.py" model=tiny_sdxl quantized_unet="$checkpoint" infer.width=64 infer.height=64
python "$here/infer_trt.py" model=tiny_sdxl backend=onnxruntime sampling.width=64 sampling.height=64 sampling.steps=4
python "$here/evaluate.py" model=tiny_sdxl +variants.int8="$checkpoint" +variants.int8_onnx=sdxl_export/onnx/unet_xl/model.onnx \
    sampling.width=64 sampling.height=64 sampling.steps=4
