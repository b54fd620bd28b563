"""Quantization: the recipe's levels, calibration over denoising steps, and the checkpoint."""
