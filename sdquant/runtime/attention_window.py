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

Heads differ: some put nearly all their attention on nearby frames, others spread it over the
video, so a window for every head loses what one for the local heads keeps. A recording run
(`record_to`) draws with every key and notes each head's share of attention inside the window;
with that file (`heads_file`), the heads of at least `min_share` attend within the window and the
others to every key, as two attention calls a layer.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ..artifacts import write_json
from ..errors import UserError

# An attention layer's mark: the TemporalWindow it attends within.
WINDOW = "sdquant_window"
# A windowed layer's mark where only some of its heads attend within the window: a HeadSplit.
WINDOW_HEADS = "sdquant_window_heads"
# A layer's mark while its heads' shares inside a window are recorded: a ShareRecorder.
SHARES = "sdquant_window_shares"
# The queries of a latent frame a share is estimated from, at most, evenly spaced: all of a frame's
# would need 40 GB of scores a layer at the A14B's 3,600 tokens a frame.
SAMPLED_QUERIES = 256


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


@dataclasses.dataclass(frozen=True)
class HeadSplit:
    """The heads of a layer that attend within its window (`inside`) and those that attend to every
    key (`outside`), each in order."""

    inside: tuple[int, ...]
    outside: tuple[int, ...]

    @property
    def order(self) -> list[int]:
        """Where each head's output lies in the two calls' outputs joined, inside then outside."""
        joined = [*self.inside, *self.outside]
        return sorted(range(len(joined)), key=joined.__getitem__)


class ShareRecorder:
    """A layer's heads' mean share of attention inside `window` (each query's softmax weight on the
    keys of the window, exp(lse over the window's keys - lse over all)), over the calls recorded."""

    def __init__(self, window: TemporalWindow):
        self.window = window
        self.total: torch.Tensor | None = None
        self.queries = 0

    @torch.compiler.disable
    def add(self, query: torch.Tensor, key: torch.Tensor) -> None:
        """One call's (batch, tokens, heads, head_dim) queries and keys, before attention."""
        scale = query.shape[-1] ** -0.5
        keys = key.float()
        for queries, window_keys in self.window.spans(query.shape[1]):
            stride = max(1, (queries.stop - queries.start) // SAMPLED_QUERIES)
            sampled = query[:, queries.start:queries.stop:stride].float()
            scores = torch.einsum("bqhd,bkhd->bhqk", sampled, keys) * scale
            share = (scores[..., window_keys].logsumexp(-1) - scores.logsumexp(-1)).exp()
            total = share.sum(dim=(0, 2), dtype=torch.float64)
            self.total = total if self.total is None else self.total + total
            self.queries += share.shape[0] * share.shape[2]

    def shares(self) -> list[float]:
        return (self.total / self.queries).cpu().tolist() if self.queries else []


def use_attention_window(family, modules: dict, block) -> None:
    """Marks the frame self-attention layers of the chosen backbones (`modules`, by attribute;
    `block.backbones`, None: all) but `block.dense_blocks` to attend within `block.frames` latent
    frames (with `block.heads_file`, their heads of at least `block.min_share` alone; with
    `block.record_to`, none, their shares recorded instead), each run by the family's own processor
    (sdquant.runtime.attention.attend), and hooks each such backbone to follow its latent's size. A
    backbone is windowed once: the pipeline built with it owns it."""
    if block.frames is None:
        return
    shares = read_shares(block.heads_file, block.frames) if block.heads_file else None
    for attribute, module in modules.items():
        if block.backbones is not None and attribute not in block.backbones:
            continue
        window = TemporalWindow(block.frames, lambda hidden, backbone=module: family.tokens_per_frame(backbone, hidden))
        for index, attn in family.frame_attention_layers(module).items():
            if index in block.dense_blocks:
                continue
            split = head_split(shares, attribute, index, attn.heads, block) if shares is not None else None
            if split is not None and not split.inside:
                continue
            processor = attn.processor if hasattr(attn.processor, "sequence_group") else \
                family.fp8_attention_processor(attn)
            if processor is None:
                raise UserError(f"torch_backend.attention_window: {attribute}'s block {index} runs "
                                f"{type(attn.processor).__name__}, which has no windowed form: set "
                                "torch_backend.attention_window.frames=null")
            attn.set_processor(processor)
            if block.record_to:
                setattr(attn, SHARES, ShareRecorder(window))
                continue
            setattr(attn, WINDOW, window)
            if split is not None and split.outside:
                setattr(attn, WINDOW_HEADS, split)
        module.register_forward_pre_hook(window.follow, with_kwargs=True)


def head_split(shares: dict, attribute: str, index: int, heads: int, block) -> HeadSplit:
    """Layer `index` of backbone `attribute`'s heads by their recorded share inside the window."""
    layer = shares.get(attribute, {}).get(str(index))
    if layer is None or len(layer) != heads:
        found = "no shares" if layer is None else f"{len(layer)} heads' shares"
        raise UserError(f"torch_backend.attention_window.heads_file={block.heads_file} has {found} for {attribute}'s "
                        f"block {index}, which has {heads} heads: record it for this model (record_to)")
    return HeadSplit(tuple(head for head, share in enumerate(layer) if share >= block.min_share),
                     tuple(head for head, share in enumerate(layer) if share < block.min_share))


def read_shares(path: str, frames: int, key: str = "torch_backend.attention_window") -> dict:
    """A heads file's shares, by backbone attribute and block index, checked to be of `frames`."""
    try:
        recorded = json.loads(Path(path).read_text())
        shares, recorded_frames = recorded["backbones"], recorded["frames"]
        valid = isinstance(shares, dict) and all(
            isinstance(layers, dict) and all(isinstance(share, (int, float)) for heads in layers.values()
                                             for share in heads) for layers in shares.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        valid = False
    if not valid:
        raise UserError(f"{key}.heads_file={path} is not a file of heads' shares: write one with infer_trt.py "
                        "torch_backend.attention_window.record_to")
    if recorded_frames != frames:
        raise UserError(f"{key}.heads_file={path} holds shares inside a window of "
                        f"{recorded_frames} frames, not of frames={frames}: record them for {frames}")
    return shares


def write_shares(family, modules: dict, frames: int, path: Path) -> Path:
    """Each recorded layer's heads' shares inside the window of `frames`, by backbone and block."""
    backbones = {}
    for attribute, module in modules.items():
        layers = {str(index): recorder.shares() for index, attn in family.frame_attention_layers(module).items()
                  if (recorder := getattr(attn, SHARES, None)) is not None and recorder.queries}
        if layers:
            backbones[attribute] = layers
    write_json(path, {"frames": frames, "backbones": backbones})
    return path


def window_of(attn) -> TemporalWindow | None:
    """The window layer `attn` attends within; None: every key."""
    return getattr(attn, WINDOW, None)


def heads_of(attn) -> HeadSplit | None:
    """The heads of `attn` that attend within its window, where not all do."""
    return getattr(attn, WINDOW_HEADS, None)


def recorder_of(attn) -> ShareRecorder | None:
    return getattr(attn, SHARES, None)


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
    if block.heads_file:
        read_shares(block.heads_file, block.frames, key)
    if block.record_to and Path(block.record_to).is_dir():
        raise UserError(f"{key}.record_to={block.record_to} is a folder: name the file the shares go to")
