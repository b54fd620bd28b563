"""The numeric kernels the torch backend runs a quantize.py checkpoint with, one module per number
format (fp8, int8) and FP8 attention as one fused op (fp8_attention)."""
