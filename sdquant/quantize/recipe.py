"""The quantization recipe: which backbone quantizers a (format, quant_level) pair turns on, from a
family's table of levels (sdquant.families), and how they are calibrated; recipe_identity is all of
it as data, which a checkpoint's fingerprint holds.

The ModelOpt config is an ordered list in which later entries win, so it is written as: everything
off, then what each level adds, then the family's high-precision patterns last, so that no level
can re-enable a layer that must stay in high precision.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass

import torch

from ..config import QuantFormat
from .shared_ranges import tied_groups

# ModelOpt's attention quantizers: q, k and v where they enter attention, and softmax's output.
ATTENTION_QUANTIZERS = ("q_bmm_quantizer", "k_bmm_quantizer", "v_bmm_quantizer")
SOFTMAX_QUANTIZER = "softmax_quantizer"
# Softmax outputs lie in [0, 1], so their range needs no calibration.
SOFTMAX_AMAX = 1.0
ATTENTION_LEVEL = 4.0


@dataclass(frozen=True)
class LayerGroup:
    """Layers a level adds: a quantizer-name prefix pattern and the layer class it applies to."""

    level: float
    pattern: str
    parent_class: str  # "nn.Conv2d" | "nn.Linear"


@dataclass(frozen=True)
class LevelTable:
    """A family's quant levels: the layer groups each adds (a level holds every group at or below
    it), the attention layers level 4 runs in FP8, and the patterns that stay in high precision."""

    levels: tuple[float, ...]
    groups: tuple[LayerGroup, ...]
    high_precision: tuple[str, ...]
    # The level from which the attention q/k/v projections are quantized.
    qkv_level: float
    # A quantizer-name prefix pattern of the attention layers whose q/k/v and softmax level 4
    # quantizes ("*": every one).
    attention_scope: str = "*"
    # A backbone of numbered blocks: the pattern of block {index}'s quantizers, the backbone config's
    # key for how many there are, and the blocks kept in high precision unless
    # quantize.high_precision_blocks names others.
    block_pattern: str | None = None
    block_count_key: str | None = None
    high_precision_blocks: tuple[int, ...] = ()

    def high_precision_patterns(self, blocks=None) -> tuple[str, ...]:
        """What stays in high precision: the table's patterns, and the blocks `blocks` names (None:
        the table's own)."""
        chosen = self.high_precision_blocks if blocks is None else tuple(blocks)
        return (*self.high_precision, *(self.block_pattern.format(index=index) for index in chosen))


def _num_bits(fmt: QuantFormat):
    return 8 if QuantFormat(fmt) == QuantFormat.int8 else (4, 3)


def _weight_and_input(prefix: str, parent_class: str, num_bits) -> list[dict]:
    """Activations per tensor. INT8 weights per output channel; FP8 weights per tensor, the only
    FP8 form ModelOpt exports to ONNX (E4M3's range makes one scale per tensor work well)."""
    weight_axis = 0 if num_bits == 8 else None
    return [
        {"quantizer_name": f"{prefix}weight_quantizer", "parent_class": parent_class,
         "cfg": {"num_bits": num_bits, "axis": weight_axis}},
        {"quantizer_name": f"{prefix}input_quantizer", "parent_class": parent_class,
         "cfg": {"num_bits": num_bits, "axis": None}},
    ]


def quant_cfg_entries(table: LevelTable, fmt: QuantFormat, quant_level: float,
                      high_precision_blocks=None) -> list[dict]:
    num_bits = _num_bits(fmt)
    level = float(quant_level)
    entries: list[dict] = [{"quantizer_name": "*", "enable": False}]
    for group in table.groups:
        if level >= group.level:
            entries += _weight_and_input(group.pattern, group.parent_class, num_bits)
    if level >= ATTENTION_LEVEL:
        entries += [{"quantizer_name": f"{table.attention_scope}{name}", "cfg": {"num_bits": num_bits, "axis": None}}
                    for name in ATTENTION_QUANTIZERS]
        entries.append({"quantizer_name": f"{table.attention_scope}{SOFTMAX_QUANTIZER}",
                        "cfg": {"num_bits": num_bits, "axis": None, "constant_amax": SOFTMAX_AMAX}})
    entries += [{"quantizer_name": pattern, "enable": False}
                for pattern in table.high_precision_patterns(high_precision_blocks)]
    return entries


_PARENT_CLASSES = {"nn.Conv2d": torch.nn.Conv2d, "nn.Linear": torch.nn.Linear}


def is_enabled(entries: list[dict], quantizer_name: str, module: torch.nn.Module) -> bool:
    """Whether `entries` turn on the quantizer of this name on `module`, read as ModelOpt reads
    them: the last entry whose pattern (and parent class, if given) matches decides.

    Calibration uses it to hook only the layers that will be quantized, before ModelOpt has
    inserted any quantizer; a test checks that both readings agree at every level.
    """
    enabled = False
    for entry in entries:
        parent = entry.get("parent_class")
        if parent is not None and not isinstance(module, _PARENT_CLASSES[parent]):
            continue
        if fnmatch.fnmatchcase(quantizer_name, entry["quantizer_name"]):
            enabled = entry.get("enable", True)
    return enabled


def uses_smoothquant(fmt: QuantFormat, quant_level: float) -> bool:
    """ModelOpt smooths only int8 Linear layers, which levels >= 2 quantize."""
    return QuantFormat(fmt) == QuantFormat.int8 and float(quant_level) >= 2.0


def percentile_layers(block) -> str:
    """Which activation quantizers Percentile Quant calibrates: quantize.percentile_layers, with
    auto resolved as NeMo (INT8: convolutions) and ModelOpt's diffusers example (FP8: none) do."""
    if block.percentile_layers != "auto":
        return block.percentile_layers
    return "conv" if QuantFormat(block.format) == QuantFormat.int8 else "none"


def percentile_covers(block, module: torch.nn.Module | None) -> bool:
    """Whether Percentile Quant calibrates the activation quantizer on `module` (a Conv2d or Linear;
    None for attention's q/k/v quantizers). Where it does not, the range is the plain max; under
    NeMo's recipe a Linear input's per-channel max is what SmoothQuant turns into its smoothing
    scales and then a per-tensor range."""
    covered = percentile_layers(block)
    return covered == "all" or (covered == "conv" and isinstance(module, torch.nn.Conv2d))


def calibration_algorithm(fmt: QuantFormat, quant_level: float, alpha: float):
    if uses_smoothquant(fmt, quant_level):
        return {"method": "smoothquant", "alpha": float(alpha)}
    return {"method": "max"}


def recipe_identity(table: LevelTable, block, projections) -> dict:
    """What decides which layers a calibration by quantize block `block` quantizes, and how, as plain
    data for its checkpoint's fingerprint. The whole level table, not only the rows this level
    reads, so that no edit of a row can leave an old checkpoint looking current; ModelOpt's
    quant_cfg, the algorithm and the layers Percentile Quant covers, as this code derives them from
    the table and the block, so that a change to the derivation is a new checkpoint too; and, for
    FP8, the layers whose ranges are tied after calibration (INT8 ranges are never tied), by the
    family's names for them (`projections`, sdquant.quantize.shared_ranges.AttentionProjections)."""
    fmt, level = QuantFormat(block.format), float(block.quant_level)
    identity = {"level_table": dataclasses.asdict(table),
                "quant_cfg": quant_cfg_entries(table, fmt, level, block.high_precision_blocks),
                "algorithm": calibration_algorithm(fmt, level, block.alpha),
                "percentile_layers": percentile_layers(block)}
    return {**identity, "tied_ranges": tied_groups(projections)} if fmt == QuantFormat.fp8 else identity
