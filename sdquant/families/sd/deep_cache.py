"""DeepCache for UNets (Ma et al., 2024): the deep blocks' output changes little from one
denoising step to the next, so a full UNet pass every `interval` steps keeps it, and the steps
between run only the outermost blocks, which take it in place of what the deep blocks would give.

A UNet with n down and n up blocks has n skip branches; `branch` b keeps down_blocks[:b + 1] and
up_blocks[n - 1 - b:] live on the shallow steps, and everything deeper is read from the cache: the
feature entering up_blocks[n - 1 - b]. The paper and its reference package (DeepCache's
DeepCacheSDHelper) count branches by layer instead, three to a block of SD's and SDXL's UNets (two
resnets and the downsampler): its cache_branch_id 3b + 2 is this branch b (a test draws the same
images), and its ids 3b and 3b + 1, which cut inside a block, are not offered. ModelOpt's cache
diffusion example is another cache: for SDXL it replays every down block, the mid block and
up_blocks 0-1 on odd steps and recomputes only up_blocks.2, whose skip connections from
down_blocks.0 then come from the cache too; here the live down blocks are recomputed.

Both passes are written here with the UNet's own modules in the order diffusers' forward calls them
(time and text-time embeddings, conv_in, down, mid, up with the skip connections and upsample sizes,
conv_out), so the full pass gives diffusers' output bit for bit, traces to ONNX and compiles as the
plain UNet does. Adapters, ControlNet residuals and attention masks, which no sdquant pipeline
passes, are not taken.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ...errors import UserError
from ...graphs.networks import BATCH, Network

# The backbone graph's two passes as stages and graphs (unet_xl_full, unet_xl_shallow), and the
# cached feature between them, whose height and width are the latent's halved once per skipped
# upsampler.
FULL, SHALLOW, DEEP = "{}_full", "{}_shallow", "deep"
DEEP_HEIGHT, DEEP_WIDTH = "DH", "DW"
DEEP_AXES = {0: BATCH, 2: DEEP_HEIGHT, 3: DEEP_WIDTH}


def deep_sizes(latent_height: int, latent_width: int, branch: int) -> dict[str, int]:
    """The cached feature's height and width: the latent's after the `branch` stride-2 downsamplers
    above it (each rounds up), which is where the first live up block meets it."""
    for _ in range(branch):
        latent_height, latent_width = -(-latent_height // 2), -(-latent_width // 2)
    return {DEEP_HEIGHT: latent_height, DEEP_WIDTH: latent_width}


def passes(backbone: Network) -> tuple[Network, Network]:
    """The networks of the full pass (the backbone's, and the deep feature out) and of the shallow
    pass (the backbone's inputs and the deep feature in)."""
    full = dataclasses.replace(backbone, name=FULL.format(backbone.name),
                               outputs={**backbone.outputs, DEEP: DEEP_AXES})
    shallow = dataclasses.replace(backbone, name=SHALLOW.format(backbone.name),
                                  inputs={**backbone.inputs, DEEP: DEEP_AXES}, optional=("context",))
    return full, shallow


@dataclass(frozen=True)
class DeepCache:
    """When the full UNet runs, and which blocks stay live between."""

    interval: int
    branch: int
    # Its passes export as graphs and engines, and replay as CUDA graphs.
    exported = True

    def full_step(self, step: int) -> bool:
        return step % self.interval == 0

    @property
    def stages_key(self) -> tuple:
        """What its passes' stages depend on: the branch (the interval is the data flow's to read)."""
        return ("deepcache", self.branch)

    def record(self) -> dict:
        """What the export records of its passes' graphs (and their fingerprints hold): the branch
        their engines' profiles size the cached feature by."""
        return {"deep_cache_branch": self.branch}

    def describe(self) -> str:
        return f"DeepCache, the whole UNet every {self.interval} steps, branch {self.branch} live"

    def check(self, unet_config, key: str) -> None:
        """Refuses, in one line naming `key`, a setting this UNet cannot take."""
        blocks = len(unet_config["down_block_types"])
        if self.interval < 1:
            raise UserError(f"{key}.interval={self.interval}: give a full UNet pass every 1 or more steps")
        if not 0 <= self.branch < blocks - 1:
            raise UserError(f"{key}.branch={self.branch}: this UNet has {blocks} down blocks, so the branch that stays "
                            f"live is 0 to {blocks - 2} (deeper than that nothing would be cached)")


def _embeddings(unet, x, timesteps, context, y):
    """The time (and SDXL's text-time) embedding and the encoder states, as diffusers' forward
    makes them; `y` is NeMo's add-embedding input (pooled text and time ids' Fourier features)."""
    t_emb = unet.get_time_embed(sample=x, timestep=timesteps)
    emb = unet.time_embedding(t_emb, None)
    if y is not None:
        emb = emb + unet.add_embedding(y.to(emb.dtype))
    if unet.time_embed_act is not None:
        emb = unet.time_embed_act(emb)
    return emb, unet.process_encoder_hidden_states(encoder_hidden_states=context, added_cond_kwargs=None)


def _call(block, sample, emb, context, **kwargs):
    if getattr(block, "has_cross_attention", False):
        return block(hidden_states=sample, temb=emb, encoder_hidden_states=context, **kwargs)
    return block(hidden_states=sample, temb=emb, **kwargs)


def _up(unet, blocks, sample, residuals: tuple, emb, context, forward_upsample_size: bool):
    """Runs `blocks` (a tail of the UNet's up blocks) on `sample`, each taking its skip connections
    from the end of `residuals`; returns the result and the residuals left."""
    for block in blocks:
        taken = len(block.resnets)
        skips, residuals = residuals[-taken:], residuals[:-taken]
        # As diffusers: a block that upsamples is told the size of the skip connection it meets next.
        upsample_size = residuals[-1].shape[2:] if residuals and forward_upsample_size else None
        sample = _call(block, sample, emb, context, res_hidden_states_tuple=skips, upsample_size=upsample_size)
    return sample, residuals


def _forward(unet, branch: int, x, timesteps, context, y, deep):
    """The full pass (deep is None): (output, the feature entering the first live up block); the
    shallow pass: the output with `deep` in place of everything deeper."""
    forward_upsample_size = any(side % 2 ** unet.num_upsamplers for side in x.shape[-2:])
    emb, context = _embeddings(unet, x, timesteps, context, y)
    sample = unet.conv_in(x)
    residuals = (sample,)
    live = len(unet.down_blocks) - 1 - branch
    down = unet.down_blocks if deep is None else unet.down_blocks[:branch + 1]
    for block in down:
        sample, block_residuals = _call(block, sample, emb, context)
        residuals += block_residuals
    if deep is None:
        if getattr(unet.mid_block, "has_cross_attention", False):
            sample = unet.mid_block(sample, emb, encoder_hidden_states=context)
        elif unet.mid_block is not None:
            sample = unet.mid_block(sample, emb)
        sample, residuals = _up(unet, unet.up_blocks[:live], sample, residuals, emb, context, forward_upsample_size)
        deep = sample
    else:
        # The skip connections the live up blocks take: those of conv_in and the live down blocks,
        # less what the deeper up blocks would have taken from their end.
        needed = sum(len(block.resnets) for block in unet.up_blocks[live:])
        residuals, sample = residuals[:needed], deep
    sample, _ = _up(unet, unet.up_blocks[live:], sample, residuals, emb, context, forward_upsample_size)
    if unet.conv_norm_out is not None:
        sample = unet.conv_act(unet.conv_norm_out(sample))
    return unet.conv_out(sample), deep


class _CachedPass(torch.nn.Module):
    # As for the plain UNet graph: the Fourier time embedding stays on the host in a meta trace.
    host_inputs = ("timesteps",)

    def __init__(self, unet, branch: int):
        super().__init__()
        self.unet = unet
        self.branch = branch

    def host_modules(self) -> list[torch.nn.Module]:
        return [self.unet.time_proj]


class FullPass(_CachedPass):
    """x, timesteps, context[, y] -> (out, deep): the whole UNet, and the feature to cache."""

    def forward(self, x, timesteps, context, y=None):
        return _forward(self.unet, self.branch, x, timesteps, context, y, None)


class ShallowPass(_CachedPass):
    """x, timesteps, context, [y,] deep -> out: the live blocks only, with the cached feature."""

    def forward(self, x, timesteps, context, *rest):
        y, deep = rest if len(rest) == 2 else (None, rest[0])
        return _forward(self.unet, self.branch, x, timesteps, context, y, deep)[0]
