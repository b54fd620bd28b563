"""Runtimes: the stages a pipeline runs (torch, ONNX Runtime, TensorRT) and what speeds them up."""
