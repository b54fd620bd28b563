"""The attention layers of a checkpoint that torch_backend.quantized=fp8 converts: the q/k/v
projections that read one input as one FP8 GEMM, and, where the checkpoint calibrated attention
(quant_level=4), attention itself as FP8 (sdquant.runtime.kernels.fp8_attention), its FP8 output
going into the next FP8 GEMM as it is.

torch_backend.attention_kernel picks the kernels: torch's (its scaled_dot_product_attention in 16
bits, cuDNN's FP8 attention) or FlashAttention-3's, faster on Hopper at a video's length
(benchmarks/results/fp8_attention_plans_fa3_h200.json). FlashAttention-3 is an optional install
(fa3-fwd, in the fp8-attention extra, or a source build), so auto takes it where it is installed
and the GPU is a Hopper.

Each family gives the processor that runs its attention so (ModelFamily.fp8_attention_processor):
diffusers' own processor for that attention step for step (the same reshapes, q/k norms, rotary
embedding, order of the text and image tokens and split of the output) over `project` and
`attend` here. An attention whose ranges say FP8 quantizes q, k and v where they enter attention
with those ranges; the output is rounded with the input range of the layer that reads it (to_out,
or the block's proj_out where the attention has none).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from ..errors import UserError
from .kernels.fp8_layers import Fp8Linear
from .kernels.exact import KeepsExactTensors
from .kernels.fp8 import fp8_scales, to_fp8
from .attention_window import heads_of, recorder_of, window_of
from .kernels.fp8_attention import FLASH3_MODULES, flash3_attention_rounded, flash3_function, flash3_module, fp8_attention
from ..quantize.shared_ranges import AttentionProjections, attention_layers, output_groups, projection_groups

FP8_ATTENTION = "fp8_attention"
# An attention layer's mark that it runs FlashAttention-3 (use_attention_kernel).
FLASH3 = "sdquant_flash3"
# diffusers' name for FlashAttention-3 as an attention backend.
DIFFUSERS_FLASH3 = "_flash_3"
# Its 16-bit attention's one precision: neither fa3-fwd's wheel nor the one benchmarks/build_flash3.sh
# makes has fp16 kernels, so fp16 attention (SDXL's) keeps torch's.
FLASH3_16_BIT = torch.bfloat16


def flash3_missing(device: torch.device) -> str | None:
    """Why FlashAttention-3 cannot run on `device`, in words; None when it can."""
    if device.type != "cuda":
        return f"FlashAttention-3 runs on CUDA GPUs, not on the {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return (f"FlashAttention-3's kernels are Hopper's (sm90) and {torch.cuda.get_device_name(device)} is "
                f"sm{major}{minor}")
    if flash3_module() is None:
        return (f"FlashAttention-3 is not installed (no module {' or '.join(FLASH3_MODULES)}): "
                "pip install fa3-fwd, which the fp8-attention extra brings, or build it with benchmarks/build_flash3.sh")
    return None


def chosen_kernel(asked: str, device: torch.device) -> str:
    """torch_backend.attention_kernel settled on `device`: flash3 or torch (auto: flash3 where it
    can run)."""
    why = flash3_missing(device)
    if asked == "flash3" and why:
        raise UserError(f"torch_backend.attention_kernel=flash3: {why}; set torch_backend.attention_kernel=auto "
                        "(FlashAttention-3 where it can run) or torch")
    if asked == "auto":
        return "torch" if why else "flash3"
    return asked


def fallback_note(asked: str, device: torch.device) -> str | None:
    """For a run's summary: why attention_kernel=auto ran torch's kernels on a Hopper, where
    FlashAttention-3 runs bf16 and FP8 attention once its wheel is installed; None elsewhere."""
    if asked != "auto" or device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return None
    why = flash3_missing(device)
    return f"torch_backend.attention_kernel=auto ran torch's attention kernels: {why}" if why else None


def attention_modules(root: torch.nn.Module) -> list[torch.nn.Module]:
    """diffusers' attention modules in `root`, whatever their class and their projections' form
    (the FP8 conversion fuses and removes some)."""
    return [module for module in root.modules() if hasattr(module, "set_processor")]


def use_attention_kernel(backbone: torch.nn.Module, kernel: str, split_later: bool = False) -> None:
    """Runs `backbone`'s attention with `kernel` (chosen_kernel's), in place: for flash3, its FP8
    attention and the 16-bit attention of the processors here (attend), and diffusers' own
    processors on its FlashAttention-3 backend (as its set_attention_backend sets them, less the
    checks chosen_kernel made), except where diffusers' context parallelism splits their tokens,
    which that backend does not take: those keep torch's kernel. `split_later`: context
    parallelism will split them after this (a whole call to compare with the split one): they
    keep torch's kernel already."""
    if kernel != "flash3":
        return
    provide_diffusers_flash3()
    diffusers_layers = not split_later and getattr(backbone, "dtype", None) == FLASH3_16_BIT
    for attn in attention_modules(backbone):
        setattr(attn, FLASH3, True)
        processor = attn.processor
        if (diffusers_layers and hasattr(processor, "_attention_backend")
                and getattr(processor, "_parallel_config", None) is None):
            processor._attention_backend = DIFFUSERS_FLASH3


def provide_diffusers_flash3() -> None:
    """diffusers' FlashAttention-3 backend calls the function it imported from the source build's
    module when diffusers was imported, and holds None where only fa3-fwd is installed: it is
    handed fa3-fwd's, which takes the same arguments. (Without either, as in the CPU tests, the
    layers run their twins.)"""
    from diffusers.models import attention_dispatch

    if attention_dispatch.flash_attn_3_func is None and flash3_module() is not None:
        attention_dispatch.flash_attn_3_func = flash3_function()


def flash3_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """FlashAttention-3 on (batch, tokens, heads, head_dim) q, k and v in 16 bits, through diffusers'
    backend (an op torch.compile traces as one node)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    return dispatch_attention_fn(query, key, value, backend=DIFFUSERS_FLASH3)


class Fp8Attention(KeepsExactTensors, torch.nn.Module):
    """One attention layer's FP8 attention: the ranges of its q, k and v where they enter attention,
    and the input range of the layer that reads its output."""

    exact = ("q_inverse_scale", "q_scale", "k_inverse_scale", "k_scale", "v_inverse_scale", "v_scale",
             "out_inverse_scale", "out_scale")

    def __init__(self, amax: dict[str, torch.Tensor], reader: Fp8Linear):
        super().__init__()
        device = reader.input_scale.device
        for role in ("q", "k", "v"):
            inverse, scale = fp8_scales(amax[role])
            self.register_buffer(f"{role}_inverse_scale", inverse.to(device))
            self.register_buffer(f"{role}_scale", scale.to(device))
        self.register_buffer("out_inverse_scale", reader.input_inverse_scale.clone())
        self.register_buffer("out_scale", reader.input_scale.clone())

    # Where the values go in less their mean over the tokens (see forward): the device types whose
    # FP8 attention adds P.V into an accumulator that can lose their shared part (Hopper's tensor
    # cores); the CPU twin sums in fp32 and stays ModelOpt's computation.
    centred_on = ("cuda",)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                flash3: bool = False) -> torch.Tensor:
        """(batch, heads, tokens, head_dim) q, k and v in the model's precision -> the FP8 output;
        `flash3`: FlashAttention-3's op rather than cuDNN's (on the CPU, its twin, through 16 bits).

        On a GPU the values go in less their mean over the tokens, which the output gets back: the
        same attention, each row of softmax summing to 1. Hopper's FP8 tensor cores add each block
        of keys' P.V into an accumulator of fewer bits than fp32, so a part every value shares,
        whose sum grows with each block, stops being added once that sum dwarfs a block's share:
        at 75,600 tokens an A14B block's attention kept 57% of its output's size, and came 0.1%
        from exact attention with the mean taken out (benchmarks/results/
        wan_fp8_attention_length_h100.txt). Values on both sides of their mean spread up to twice
        their calibrated range, and so does their attention: both are rounded in ranges twice as
        wide, which in E4M3 costs no precision above its subnormals."""
        q8, k8 = to_fp8(query, self.q_inverse_scale), to_fp8(key, self.k_inverse_scale)
        softmax_scale = query.shape[-1] ** -0.5
        attention = flash3_attention_rounded if flash3 else fp8_attention
        if value.device.type not in self.centred_on:
            return attention(q8, k8, to_fp8(value, self.v_inverse_scale), self.q_scale, self.k_scale,
                             self.v_scale, softmax_scale, self.out_inverse_scale)
        mean = value.mean(dim=2, keepdim=True, dtype=torch.float32)
        centred = attention(q8, k8, to_fp8(value - mean, self.v_inverse_scale / 2), self.q_scale, self.k_scale,
                            self.v_scale * 2, softmax_scale, self.out_inverse_scale / 2)
        return to_fp8(centred.float() * (self.out_scale * 2) + mean, self.out_inverse_scale)

    def dequantize(self, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """For a reader that takes it in the model's precision: its FP8 input quantizer rounds these
        values back to the very same FP8 ones."""
        return (out.float() * self.out_scale).to(dtype)


def project(attn, x: torch.Tensor, group: tuple[tuple[str, ...], str]) -> tuple[torch.Tensor, ...]:
    """The group's projections of `x`, by its fused GEMM where the conversion made one."""
    names, fused_name = group
    fused = getattr(attn, fused_name, None)
    if fused is not None:
        return fused(x).chunk(len(names), dim=-1)
    return tuple(getattr(attn, name)(x) for name in names)


def attend(attn, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sequence=None,
           keys_whole: bool = False) -> torch.Tensor:
    """Attention of (batch, tokens, heads, head_dim) q, k and v, as the processors split their
    projections, to (batch, tokens, heads * head_dim): FP8 where the layer has its ranges, else in
    the model's precision, as diffusers runs it; with FlashAttention-3's kernels where the layer is
    marked so (use_attention_kernel); where the layer attends within a window of frames
    (sdquant.runtime.attention_window), one call per latent frame over the keys of its window, for
    its heads that do where not all do, and one over every key for the others.

    `sequence`: the process group the layer's tokens are split over (parallel.ulysses). Each process
    holds its share of the queries, and of the keys and values unless `keys_whole` (cross-attention
    on the whole text); one all-to-all gives each process every token of its share of the heads,
    another gives each its own tokens of every head back (Ulysses attention)."""
    if sequence is not None:
        query, key, value = _heads_of_every_token(query, key, value, sequence, keys_whole)
    recorder, window, split = recorder_of(attn), window_of(attn), heads_of(attn)
    if recorder is not None:
        recorder.add(query, key)
    if window is None:
        out = _attention(attn, query, key, value)
    elif split is None:
        out = _windowed(attn, window, query, key, value)
    else:
        inside, outside = ([x[:, :, list(heads)] for x in (query, key, value)] for heads in (split.inside, split.outside))
        out = _joined([_windowed(attn, window, *inside), _attention(attn, *outside)], dim=2, order=split.order)
    if sequence is not None:
        out = _every_head_of_own_tokens(out, sequence)
    return out.flatten(2)


def _attention(attn, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """(batch, tokens, heads, head_dim) q, k and v -> (batch, tokens, heads, head_dim), on the
    layer's kernels (attend)."""
    fp8, flash3 = getattr(attn, FP8_ATTENTION, None), getattr(attn, FLASH3, False)
    if fp8 is None and flash3 and query.dtype == FLASH3_16_BIT:
        return flash3_attention(query, key, value)
    query, key, value = (x.transpose(1, 2) for x in (query, key, value))
    out = F.scaled_dot_product_attention(query, key, value) if fp8 is None else fp8(query, key, value, flash3)
    return out.transpose(1, 2)


def _windowed(attn, window, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Attention within `window`: each latent frame's queries over its window's keys."""
    return _joined([_attention(attn, query[:, queries], key[:, keys], value[:, keys])
                    for queries, keys in window.spans(query.shape[1])])


def _joined(parts: list[torch.Tensor], dim: int = 1, order: list[int] | None = None) -> torch.Tensor:
    """Attention outputs (batch, tokens, heads, head_dim) joined along `dim` (each latent frame's
    tokens, or the heads of two calls, then put in `order`); FP8 outputs joined as bytes, which
    every device's cat and indexing take."""
    one_byte = parts[0].element_size() == 1
    joined = torch.cat([part.view(torch.uint8) if one_byte else part for part in parts], dim=dim)
    if order is not None:
        joined = joined[:, :, order]
    return joined.view(parts[0].dtype) if one_byte else joined


def _exchange(chunks: torch.Tensor, group) -> torch.Tensor:
    """All-to-all of (processes, ...) chunks: chunk j goes to process j, and the result's chunk j
    came from it. One-byte (FP8) values travel as bytes, which every backend carries. The
    functional collective is the form torch.compile traces into the graph (c10d's in-place one
    would break it at every attention layer)."""
    import torch.distributed._functional_collectives as funcol

    chunks = chunks.contiguous()
    sent = chunks.view(torch.uint8) if chunks.element_size() == 1 else chunks
    received = funcol.all_to_all_single(sent, None, None, group)
    if isinstance(received, funcol.AsyncCollectiveTensor):
        received = received.wait()
    return received.view(chunks.dtype)


def _heads_of_every_token(query, key, value, group, keys_whole: bool) -> tuple[torch.Tensor, ...]:
    """(batch, own tokens, heads, dim) -> (batch, every token, own heads, dim); keys and values
    held whole keep their tokens and give up the other processes' heads."""
    import torch.distributed as dist

    size, rank = dist.get_world_size(group), dist.get_rank(group)

    def gathered(x: torch.Tensor) -> torch.Tensor:
        batch, tokens, heads, dim = x.shape
        chunks = x.reshape(batch, tokens, size, heads // size, dim).permute(2, 0, 1, 3, 4)
        return _exchange(chunks, group).permute(1, 0, 2, 3, 4).reshape(batch, size * tokens, heads // size, dim)

    if keys_whole:
        key, value = (x.chunk(size, dim=2)[rank] for x in (key, value))
        return gathered(query), key, value
    return gathered(query), gathered(key), gathered(value)


def _every_head_of_own_tokens(out: torch.Tensor, group) -> torch.Tensor:
    """(batch, every token, own heads, dim) -> (batch, own tokens, heads, dim)."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    batch, tokens, heads, dim = out.shape
    chunks = out.reshape(batch, size, tokens // size, heads, dim).permute(1, 0, 2, 3, 4)
    return _exchange(chunks, group).permute(1, 2, 0, 3, 4).reshape(batch, tokens // size, size * heads, dim)


def no_mask(attention_mask) -> None:
    if attention_mask is not None:
        raise ValueError("a converted attention layer takes no attention mask (no sdquant pipeline passes one)")


def _fuse(attn, group: tuple[tuple[str, ...], str]) -> bool:
    """Replaces the group's FP8 layers with one GEMM where their scales allow (see Fp8Linear.stacked)."""
    names, fused_name = group
    layers = [getattr(attn, name) for name in names]
    stacked = Fp8Linear.stacked(layers) if all(isinstance(layer, Fp8Linear) for layer in layers) else None
    if stacked is None:
        return False
    setattr(attn, fused_name, stacked)
    for name in names:
        delattr(attn, name)
    return True


def _output_reader(backbone, name: str, attn, names: AttentionProjections) -> Fp8Linear:
    """The FP8 layer whose input range the attention output is rounded with: to_out (which a joint
    attention's to_add_out must share, as quantize.py ties them), or for an attention without one (a
    Flux single block's) its block's proj_out."""
    if isinstance(getattr(attn, "to_out", None), torch.nn.ModuleList):
        readers = [attn.get_submodule(layer) for group in output_groups(attn, names) for layer in group] or [attn.to_out[0]]
    else:
        readers = [backbone.get_submodule(name.rpartition(".")[0]).proj_out]
    first = readers[0]
    if not all(isinstance(reader, Fp8Linear) and torch.equal(reader.input_scale, first.input_scale) for reader in readers):
        raise UserError(f"{name}: FP8 attention needs the layers reading its output to be FP8 layers sharing one "
                        "input range, which quantize.py ties from this version on: quantize the checkpoint again, or "
                        "set torch_backend.attention=fp16")
    return first


def convert_attention(backbone: torch.nn.Module, ranges: dict[str, dict[str, torch.Tensor]], processor_for,
                      names: AttentionProjections) -> int:
    """Gives each attention layer of `backbone` (whose Linear layers are already Fp8Linear) its
    fused projections and, where `ranges` names it ({layer: q, k, v amax}), FP8 attention, run by
    the processor `processor_for(layer)` gives (its family's; None: the layer stays as it is);
    `names`: what the family's attention layers call their projections. Returns how many run FP8
    attention."""
    fp8_layers = 0
    for name, attn in attention_layers(backbone, names):
        processor = processor_for(attn)
        if processor is None:
            if name in ranges:
                raise UserError(f"{name}: FP8 attention runs diffusers' default attention processors only, and this "
                                f"layer runs {type(attn.processor).__name__}: set torch_backend.attention=fp16")
            continue
        fused = [_fuse(attn, group) for group in projection_groups(attn, names)]
        if name in ranges:
            attn.add_module(FP8_ATTENTION, Fp8Attention(ranges[name], _output_reader(backbone, name, attn, names)))
            fp8_layers += 1
        if any(fused) or name in ranges:
            attn.set_processor(processor)
    return fp8_layers
