"""8-bit post-training quantization of diffusion backbones (UNets and DiTs, images and video), run
fast on NVIDIA GPUs: exported to ONNX and TensorRT, or compiled with the project's own kernels."""

import warnings
from importlib import metadata

# ModelOpt warns at import that this transformers release is newer than it was tested with; the
# test suite covers the combination we pin, so the warning only adds noise to every script run.
warnings.filterwarnings("ignore", message=r".*transformers .* is not tested with current version of modelopt")

try:
    __version__ = metadata.version("sdquant")  # pyproject.toml's, as pip installed it
except metadata.PackageNotFoundError:  # a checkout on PYTHONPATH that pip has not installed
    __version__ = "unknown (not installed)"
