"""The peers: diffusers' pipelines set up as their documentation advises (torch.compile's mode,
torchao's dynamic FP8 on the backbone), and the compile arguments both sides take."""

from __future__ import annotations

import argparse
import time

import torch

from sdquant.config import TORCH_ATTENTION_KERNELS, TorchBackendBlock
from sdquant.runtime.attention import DIFFUSERS_FLASH3, chosen_kernel
from sdquant.runtime import torch_backend


def add_compile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tune-kernels", action="store_true",
                        help="compile with coordinate descent tuning, the peer included (our "
                             "torch_backend.tune_kernels=true); names each variant <variant>_tuned")
    parser.add_argument("--exact-gelu", action="store_true",
                        help="our variants keep torch's tanh GELU (no sigmoid form, "
                             "sdquant.runtime.compiled_forms); names each variant <variant>_exact_gelu")


def use_compile_arguments(args) -> None:
    """--exact-gelu: our variants keep torch's tanh GELU (speed_up looks the form up here)."""
    if args.exact_gelu:
        torch_backend.use_sigmoid_gelu = lambda module: None


def peer_compile(tuned: bool, mode: str = "default") -> dict:
    """torch.compile's keywords for the peer: its mode, and with --tune-kernels the tuning ours
    gets (the setting diffusers' own torch.compile guide gives)."""
    return torch_backend.compile_settings(TorchBackendBlock(compile_mode=mode, tune_kernels=tuned))


def variant_name(variant: str, args, ours: bool) -> str:
    return variant + "_tuned" * args.tune_kernels + "_exact_gelu" * (args.exact_gelu and ours)


# diffusers' pipeline as a user would speed it up: torch.compile's mode, and the granularity of
# torchao's dynamic FP8 on the backbone's Linear layers (None: 16 bits).
PEERS = {"peer": ("default", None), "peer_cudagraphs": ("reduce-overhead", None),
         "peer_autotune": ("max-autotune-no-cudagraphs", None), "torchao_row": ("default", "PerRow"),
         "torchao_tensor": ("default", "PerTensor")}


def torchao_fp8(backbone, granularity: str) -> dict:
    """Turns `backbone`'s Linear layers into torchao's dynamic FP8 at `granularity` (PerRow or
    PerTensor) as torchao_probe.torchao_config sets it up (the activation scale floored), compiled
    with torch's default settings; returns what it did and what torchao's import said (its version,
    which of its C++ extensions loaded: its FP8 Linear layers call torch._scaled_mm and need none
    of them)."""
    from torchao_probe import import_torchao, torchao_config

    _, status = import_torchao()
    from torchao.quantization import quantize_

    print(f"torchao {status['version']}, C++ extensions loaded: {status['cpp_extensions_loaded'] or 'none'}; "
          f"quantize_ with {granularity}", flush=True)
    start = time.perf_counter()
    # Not the compiler settings torchao recommends (set_inductor_config: coordinate descent tuning,
    # every direction, for the whole process): under them SDXL's UNet at batch 8 had not compiled
    # after 13 minutes on an H100, where torch's defaults take about 3, and a family's rows must fit
    # one lease of a GPU. Our rows are not tuned either (torch_backend.tune_kernels defaults off).
    config = torchao_config(granularity, inductor_config=False)
    quantize_(backbone, config)
    linear = [module for module in backbone.modules() if isinstance(module, torch.nn.Linear)]
    return {**status, "granularity": granularity, "activation_value_lb": config.activation_value_lb,
            "set_inductor_config": config.set_inductor_config, "quantize_s": time.perf_counter() - start,
            "fp8_linear_layers": sum(type(module.weight) is not torch.nn.Parameter for module in linear),
            "linear_layers": len(linear)}


def compile_peer(pipe, backbone: str, variant: str, tuned: bool) -> dict:
    """Compiles `pipe`'s backbone (after torchao's FP8 for a torchao variant) and its VAE decoder as
    `variant` of PEERS does, after the family's own recipe; returns what the row records of it."""
    mode, granularity = PEERS[variant]
    module = getattr(pipe, backbone)
    record = {"compile_mode": mode, "dtype": str(module.dtype).removeprefix("torch.")}
    if granularity:
        record["torchao"] = torchao_fp8(module, granularity)
    if mode == "reduce-overhead":
        torch._logging.set_logs(perf_hints=True)  # says why a graph runs without its CUDA graph, if one does
    setattr(pipe, backbone, torch.compile(module, fullgraph=True, **peer_compile(tuned, mode)))
    pipe.vae.decode = torch.compile(pipe.vae.decode, fullgraph=True, **peer_compile(tuned, mode))
    print(f"{variant}: first call (compiles, mode {mode})", flush=True)
    return record


def cudagraph_skips() -> int:
    """How often inductor ran a graph without the CUDA graph its mode asked for (reduce-overhead)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def add_attention_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--attention-kernel", default="auto", choices=TORCH_ATTENTION_KERNELS,
                        help="ours: torch_backend.attention_kernel; the peer: flash3 runs diffusers' FlashAttention-3 "
                             "backend (set_attention_backend), torch or auto its default; a kernel other than auto "
                             "names each variant <variant>_<kernel>")


def peer_attention(modules: list, kernel: str, device: torch.device) -> str:
    """The peer's attention kernel on diffusers' modules: its FlashAttention-3 backend for flash3,
    else diffusers' default (torch's SDPA)."""
    if kernel != "flash3":
        return "torch"
    chosen_kernel("flash3", device)
    for module in modules:
        module.set_attention_backend(DIFFUSERS_FLASH3)
    return "flash3"
