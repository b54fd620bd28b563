"""The numeric kernels the torch backend runs a quantize.py checkpoint with: FP8 rounding as ModelOpt
computes it (fp8) and FP8 attention as one fused op (fp8_attention)."""
