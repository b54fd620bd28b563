#!/usr/bin/env bash
# The whole workflow on the tiny built-in SDXL (no download), writing into the current folder:
# calibrate and quantize the UNet to INT8, export ONNX and build TensorRT(-RTX) engines, then
# generate an image. The last step runs the exported graphs with ONNX Runtime, since engines need
# a GPU they were built for.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python "$here/quantize.py" model=tiny_sdxl quantize.quant_level=3 quantize.n_steps=4 quantize.calib_size=4 \
    out_dir=quantized
python "$here/export_trt.py" model=tiny_sdxl \
    quantized_unet=quantized/nemo_tiny_sdxl_int8_l3_a0.8_min-mean_p1_s4_c4_b1_seed42 infer.width=64 infer.height=64
python "$here/infer_trt.py" model=tiny_sdxl backend=onnxruntime sampling.width=64 sampling.height=64 sampling.steps=4
