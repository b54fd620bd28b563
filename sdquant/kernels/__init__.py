"""The torch backend's kernels for quantize.py checkpoints, one module per number format."""
