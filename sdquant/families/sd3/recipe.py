"""SD3.5's quantization levels: the layer groups each adds and what stays in high precision."""

from __future__ import annotations

from ...quantize.recipe import LayerGroup, LevelTable

# The MMDiT's levels (every layer of its blocks is a Linear, so there is no level 1): 2 the
# feed-forward layers of both streams; 2.5 + the q/k/v projections of the joint attention (image
# and text) and of SD3.5-medium's second, image-only attention (attn2); 3 + the rest of every block
# (the attention outputs to_out and to_add_out); 4 = 3 + FP8 attention in every block: each joint
# attention runs over the image's and the text's tokens (4096 + 333 at 1024x1024), long enough for
# FP8 attention to pay. High precision, as in Flux's recipe: the patch, text and timestep embedders,
# every AdaLN modulation (norm1.linear, norm1_context.linear: its output scales and shifts every
# activation of its block, and it is a batch-row GEMM with nothing to gain) and norm_out/proj_out
# (its output is the velocity itself). ModelOpt's diffusers example keeps the embedders and norm_out
# in high precision too, but quantizes proj_out and the AdaLN modulations.
LEVELS = LevelTable(
    levels=(2.0, 2.5, 3.0, 4.0),
    groups=(LayerGroup(2.0, "*.ff.net.*", "nn.Linear"), LayerGroup(2.0, "*.ff_context.net.*", "nn.Linear"),
            LayerGroup(2.5, "*.attn.to_[qkv].", "nn.Linear"), LayerGroup(2.5, "*.attn2.to_[qkv].", "nn.Linear"),
            LayerGroup(2.5, "*.attn.add_[qkv]_proj.", "nn.Linear"),
            LayerGroup(3.0, "*", "nn.Linear")),
    high_precision=("pos_embed.*", "context_embedder.*", "time_text_embed.*", "*norm*", "proj_out.*"),
    qkv_level=2.5,
)
