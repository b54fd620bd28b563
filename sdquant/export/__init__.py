"""Export: the ONNX graphs with their Q/DQ pairs, TensorRT engines and their LoRA refit."""
