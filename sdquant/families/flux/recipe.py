"""Flux's quantization levels: the layer groups each adds and what stays in high precision."""

from __future__ import annotations

from ...quantize.recipe import LayerGroup, LevelTable

# The DiT's levels (every layer is a Linear, so there is no level 1): 2 the feed-forward layers of
# both streams and the single blocks' MLP input projection; 2.5 + the q/k/v projections of both
# streams; 3 + the rest of every block (attention outputs, the single blocks' joint output); 4 = 3
# + FP8 attention, in every block: each is joint attention over the image and text tokens (4608 at
# 1024x1024), long enough for FP8 attention to pay. High precision: the embedders of the image, text,
# timestep and guidance, every AdaLN modulation (norm*.linear: its output scales and shifts every activation of its block, and
# it is a batch-row GEMM with nothing to gain), and the final norm_out/proj_out.
LEVELS = LevelTable(
    levels=(2.0, 2.5, 3.0, 4.0),
    groups=(LayerGroup(2.0, "*.ff.net.*", "nn.Linear"), LayerGroup(2.0, "*.ff_context.net.*", "nn.Linear"),
            LayerGroup(2.0, "*.proj_mlp.", "nn.Linear"),
            LayerGroup(2.5, "*.attn.to_[qkv].", "nn.Linear"), LayerGroup(2.5, "*.attn.add_[qkv]_proj.", "nn.Linear"),
            LayerGroup(3.0, "*", "nn.Linear")),
    high_precision=("x_embedder.*", "context_embedder.*", "time_text_embed.*", "*norm*", "proj_out.*",
                    "pos_embed.*"),
    qkv_level=2.5,
)
