"""Video self-attention that computes less: each query attends to the keys of the latent frames
within a few of its own (torch_backend.attention_window), on the backbones and blocks chosen.

A video backbone's tokens lie frame after frame, so the queries of one latent frame and the keys of
the frames within `frames` of it are each one contiguous run of tokens: the window is one
attention call per latent frame, its queries against that run of keys, on whichever kernel the
layer runs (torch's, cuDNN's FP8, FlashAttention-3's), none of which computes a score outside it.
At the A14B's 720p, 21 latent frames of 3,600 tokens, a window of 3 frames leaves 7 of 21 frames'
keys to each query (fewer at the ends): 31% of the scores. The tokens a frame holds are set per call
from the latent's shape (TemporalWindow.follow, a hook on the backbone), so one setting serves every
size and length; torch.compile specializes on them as on the shapes.
"""

from __future__ import annotations

from ..errors import UserError

# An attention layer's mark: the TemporalWindow it attends within.
WINDOW = "sdquant_window"


class TemporalWindow:
    """One backbone's window: the queries of each latent frame attend to the keys of the `frames`
    latent frames either side of it and its own; `tokens_per_frame`, the latent's for the call
    under way (follow)."""

    def __init__(self, frames: int, tokens_per_frame_of):
        self.frames = frames
        # hidden_states (batch, channels, frames, height, width) -> tokens per latent frame.
        self.tokens_per_frame_of = tokens_per_frame_of
        self.tokens_per_frame: int | None = None

    def follow(self, module, args, kwargs) -> None:
        """The backbone's forward pre-hook: the tokens of a latent frame in this call. Within a
        compiled backbone they are written before any layer reads them, so the compiled code holds
        them as a constant of the shapes it was compiled for."""
        hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        self.tokens_per_frame = self.tokens_per_frame_of(hidden_states)

    def spans(self, tokens: int) -> list[tuple[slice, slice]]:
        """For a sequence of `tokens`, each latent frame's queries and the keys they attend to."""
        per_frame = self.tokens_per_frame
        if per_frame is None or tokens % per_frame:
            raise RuntimeError(f"an attention window over {tokens} tokens of {per_frame} a frame: the window follows "
                               "the backbone's latent, so call the backbone module itself")
        frames = tokens // per_frame
        return [(slice(frame * per_frame, (frame + 1) * per_frame),
                 slice(max(0, frame - self.frames) * per_frame, min(frames, frame + self.frames + 1) * per_frame))
                for frame in range(frames)]


def use_attention_window(family, modules: dict, block) -> None:
    """Marks the frame self-attention layers of the chosen backbones (`modules`, by attribute;
    `block.backbones`, None: all) but `block.dense_blocks` to attend within `block.frames` latent
    frames, each run by the family's own processor (sdquant.runtime.attention.attend), and hooks
    each such backbone to follow its latent's size. A backbone is windowed once: the pipeline built
    with it owns it."""
    if block.frames is None:
        return
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
        module.register_forward_pre_hook(window.follow, with_kwargs=True)


def window_of(attn) -> TemporalWindow | None:
    """The window layer `attn` attends within; None: every key."""
    return getattr(attn, WINDOW, None)


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
