"""Video self-attention that computes less: each query attends to the keys within a few latent
frames of its own (torch_backend.attention_window), on the backbones and blocks chosen.

A video backbone's tokens lie frame after frame, so the keys within `frames` frames of a query are
those within `frames` x (tokens per frame) positions of it: FlashAttention-3's local window
(window_size) over that band skips every key block wholly outside it, in 16 bits and in FP8. At the
A14B's 720p, 21 latent frames of 3,600 tokens, a window of 3 frames leaves about 27% of the scores
to compute. The band is set per call from the latent's shape (TemporalWindow.follow, a hook on the
backbone), so one setting serves every size and length; torch.compile specializes on it as on the
shapes. On the CPU the same band runs as a mask over torch's attention (the twins'), which is how
its quality is measured; it computes every score, so it is no faster there.
"""

from __future__ import annotations

import torch

from ..errors import UserError

# An attention layer's mark: the TemporalWindow it attends within.
WINDOW = "sdquant_window"


class TemporalWindow:
    """One backbone's window: `frames` latent frames either side of each query; `band`, the same in
    tokens for the call under way (follow)."""

    def __init__(self, frames: int, tokens_per_frame):
        self.frames = frames
        # hidden_states (batch, channels, frames, height, width) -> tokens per latent frame.
        self.tokens_per_frame = tokens_per_frame
        self.band: int | None = None

    def follow(self, module, args, kwargs) -> None:
        """The backbone's forward pre-hook: the band in tokens of this call's latent. Within a
        compiled backbone the band is written before any layer reads it, so the compiled code
        holds it as a constant of the shapes it was compiled for."""
        hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        self.band = self.frames * self.tokens_per_frame(hidden_states)


def check_window_kernel(block, kernel: str, device: torch.device) -> None:
    """Refuses a window where it would compute every score anyway: on a GPU it runs on
    FlashAttention-3's kernels (torch_backend.attention_kernel settled to flash3)."""
    if block.frames is None or device.type != "cuda" or kernel == "flash3":
        return
    raise UserError(f"torch_backend.attention_window.frames={block.frames}: on a GPU the window runs on "
                    "FlashAttention-3's local window, which skips the keys outside it; torch's kernels would "
                    "compute every score and mask them, slower than no window. Install fa3-fwd (the "
                    "fp8-attention extra) on a Hopper and set torch_backend.attention_kernel=auto or flash3, or "
                    "set torch_backend.attention_window.frames=null")


def use_attention_window(family, modules: dict, block) -> int:
    """Marks the frame self-attention layers of the chosen backbones (`modules`, by attribute;
    `block.backbones`, None: all) but `block.dense_blocks` to attend within `block.frames` latent
    frames, each run by the family's own processor (sdquant.runtime.attention.attend), and hooks
    each such backbone to follow its latent's size. Returns how many layers attend so."""
    if block.frames is None:
        return 0
    windowed = 0
    for attribute, module in modules.items():
        if block.backbones is not None and attribute not in block.backbones:
            continue
        window = TemporalWindow(block.frames, lambda hidden, backbone=module: family.tokens_per_frame(backbone, hidden))
        for index, attn in family.frame_attention_layers(module).items():
            if index in block.dense_blocks:
                continue
            processor = attn.processor if hasattr(attn.processor, "sequence_group") else \
                family.fp8_attention_processor(attn)
            if processor is None:
                raise UserError(f"torch_backend.attention_window: {attribute}'s block {index} runs "
                                f"{type(attn.processor).__name__}, which has no windowed form: set "
                                "torch_backend.attention_window.frames=null")
            attn.set_processor(processor)
            setattr(attn, WINDOW, window)
            windowed += 1
        module.register_forward_pre_hook(window.follow, with_kwargs=True)
    return windowed


def window_band(attn) -> int:
    """The band in tokens that layer `attn` attends within for the call under way; -1: every key."""
    window = getattr(attn, WINDOW, None)
    return -1 if window is None else window.band


def check_attention_window(model, block, key: str, backend: str, kernels, checkpoint, ulysses: int = 1) -> None:
    """An attention window (named `key`) against the model and what runs it, before any work: a
    video model's backbones and blocks, the torch backend, kernels that have a windowed form (the
    16-bit backbone, or a checkpoint on its format's kernels), and its tokens whole in each process."""
    if block.frames is None:
        return
    if ulysses > 1:
        raise UserError(f"{key}.frames={block.frames} with parallel.ulysses={ulysses}: the window runs on each "
                        "process's whole sequence; split the guidance halves (parallel.cfg=2) or the prompts instead")
    family = model.family
    blocks = family.frame_attention_blocks(model.parts.get("backbone_config") or {})
    if blocks is None:
        raise UserError(f"{key}.frames={block.frames}: model={model.name} draws images, which have no frames to "
                        "attend within: set it null")
    if backend != "torch":
        raise UserError(f"{key}.frames={block.frames} changes the attention of the diffusers modules: run it with "
                        f"backend=torch, not backend={backend}")
    if checkpoint is not None and kernels.quantized == "fake":
        raise UserError(f"{key}.frames={block.frames}: ModelOpt's fake quantization runs attention its own way: set "
                        f"torch_backend.quantized={checkpoint.format} to run the checkpoint on its kernels")
    unknown = [name for name in block.backbones or () if name not in family.backbone_attributes]
    if unknown:
        raise UserError(f"{key}.backbones: {', '.join(unknown)} is not among model={model.name}'s backbones "
                        f"({', '.join(family.backbone_attributes)})")
    if any(index >= blocks for index in block.dense_blocks):
        raise UserError(f"{key}.dense_blocks={list(block.dense_blocks)}: model={model.name}'s backbones have blocks "
                        f"0 to {blocks - 1}")
