"""Wan2.2's quantization levels: the layer groups each adds and what stays in high precision."""

from __future__ import annotations

from ...quantize.recipe import LayerGroup, LevelTable

# The experts' levels: every layer of their blocks is a Linear (the patch embedding, a Conv3d, stays
# in 16 bits), so there is no level 1: 2 the feed-forward layers; 2.5 + the q/k/v projections of the
# self- and cross-attention; 3 + the rest (attention outputs); 4 = 3 + FP8 self-attention (attn1, over
# the video's 75,600 tokens at 720p: 1.44x bf16 attention in cuDNN's FP8 kernel on an H100); the
# cross-attention over UMT5's 512 tokens stays 16-bit. High precision, as ModelOpt's Wan filter
# keeps them: the patch, text and time embedders (condition_embedder), the output projection, and
# the first and last three of the A14B's 40 blocks (a 30-block TI2V-5B keeps its first three, as
# ModelOpt's literal block numbers do); the norms (which ModelOpt leaves to its default config).
HIGH_PRECISION = ("patch_embedding*", "condition_embedder*", "proj_out*", "*norm*")
LEVELS = LevelTable(
    levels=(2.0, 2.5, 3.0, 4.0),
    groups=(LayerGroup(2.0, "*.ffn.net.*", "nn.Linear"), LayerGroup(2.5, "*.attn[12].to_[qkv].", "nn.Linear"),
            LayerGroup(3.0, "*", "nn.Linear")),
    high_precision=HIGH_PRECISION,
    qkv_level=2.5,
    attention_scope="*.attn1.",
    block_pattern="blocks.{index}.*",
    block_count_key="num_layers",
    high_precision_blocks=(0, 1, 2, 37, 38, 39),
)
