"""The UNet's quantization levels (NeMo's), which SD and SDXL share: the layer groups each adds and what
stays in high precision."""

from __future__ import annotations

from ...quantize.recipe import LayerGroup, LevelTable

# Layers whose ranges are too wide, or whose error spreads to every pixel, for 8 bits.
HIGH_PRECISION = ("*time_embedding*", "*time_emb_proj*", "*add_embedding*", "*conv_in*", "*conv_out*",
                  "*conv_shortcut*", "*norm*")
# NeMo's levels: 1 convolutions, 2 + feed-forward Linear, 2.5 + attention q/k/v, 3 every Linear,
# 4 = 3 + FP8 self-attention (attn1). Cross-attention (attn2) stays in 16 bits at level 4: its 77
# keys give FP8 attention nothing to gain (cuDNN's FP8 kernel ran it at 0.59x the speed of fp16
# attention on an H100), so fake quantization, the export and the torch backend's kernel all keep
# it as it is.
LEVELS = LevelTable(
    levels=(1.0, 2.0, 2.5, 3.0, 4.0),
    groups=(LayerGroup(1.0, "*", "nn.Conv2d"), LayerGroup(2.0, "*.ff.net.*", "nn.Linear"),
            LayerGroup(2.5, "*.to_[qkv].", "nn.Linear"), LayerGroup(3.0, "*", "nn.Linear")),
    high_precision=HIGH_PRECISION,
    qkv_level=2.5,
    attention_scope="*.attn1.",
)
