"""LoRA adapters (``model.loras``): checked, named by their content, and fused into the pipeline.

diffusers' own loader reads them (diffusers, PEFT and kohya/A1111 key layouts alike) into the UNet
and, where the adapter has them, the text encoders; they are then fused and the adapter layers
removed, so every later stage sees plain diffusers modules whose weights hold the adapters.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError

# What diffusers' training scripts save; a folder holding other .safetensors files is ambiguous.
DEFAULT_WEIGHT_NAME = "pytorch_lora_weights.safetensors"


@dataclass(frozen=True)
class Adapter:
    key: str        # the config key it came from, for messages: model.loras[0]
    file: Path
    scale: float
    sha256: str

    def identity(self) -> dict:
        """What changes the fused weights: the file's content and the scale, not its name."""
        return {"sha256": self.sha256, "scale": self.scale}


def adapters(loras) -> list[Adapter]:
    """`model.loras` checked and resolved; refuses a missing file or a scale that is no number."""
    return [_adapter(f"model.loras[{index}]", entry) for index, entry in enumerate(loras or [])]


def identities(loras) -> list[dict]:
    """What fingerprints and records hold of `model.loras`."""
    return [adapter.identity() for adapter in adapters(loras)]


def describe(identity: list[dict]) -> str:
    """A recorded adapter list, short enough for one line."""
    if not identity:
        return "no LoRA"
    return "[" + ", ".join(f"sha256 {item['sha256'][:12]} at scale {item['scale']:g}" for item in identity) + "]"


def _adapter(key: str, entry) -> Adapter:
    scale = entry.scale
    try:
        # bool is an int to Python, but `scale: true` is a slip, not a weight.
        if isinstance(scale, bool) or not math.isfinite(float(scale)):
            raise ValueError
    except (TypeError, ValueError):
        raise UserError(f"{key}.scale={scale!r} is not a number: give the adapter's weight, e.g. 0.8 "
                        "(0 leaves the model as it is)") from None
    file = weights_file(key, Path(str(entry.path)).expanduser())
    return Adapter(key, file, float(scale), _sha256(file.resolve(), *_stamp(file)))


def weights_file(key: str, path: Path) -> Path:
    """The adapter's .safetensors file: `path` itself, or the one file of that kind in a folder."""
    if path.is_file():
        if path.suffix != ".safetensors":
            raise UserError(f"{key}.path={path} is not a .safetensors file: convert the adapter to safetensors")
        return path
    if not path.is_dir():
        raise UserError(f"{key}.path={path}: no such LoRA file or folder")
    if (path / DEFAULT_WEIGHT_NAME).is_file():
        return path / DEFAULT_WEIGHT_NAME
    candidates = sorted(path.glob("*.safetensors"))
    if len(candidates) != 1:
        raise UserError(f"{key}.path={path} holds {len(candidates)} .safetensors files: name the adapter's file "
                        "itself")
    return candidates[0]


def _stamp(file: Path) -> tuple[int, int]:
    stat = file.stat()
    return stat.st_size, stat.st_mtime_ns


@functools.lru_cache(maxsize=None)
def _sha256(file: Path, size: int, mtime_ns: int) -> str:
    """Cached per file version: fingerprints ask for it several times in one run."""
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        for block in iter(lambda: handle.read(16 * 1024**2), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def _libraries_silent():
    """diffusers logs a failed load in full before raising it; the raised error is reported once."""
    import diffusers

    verbosity = diffusers.logging.get_verbosity()
    diffusers.logging.set_verbosity(logging.CRITICAL)
    try:
        yield
    finally:
        diffusers.logging.set_verbosity(verbosity)


def fuse(pipe, loras) -> None:
    """Loads every adapter of `loras` into `pipe` with diffusers' loader, fuses them at their scales
    and removes the adapter layers. A UNet on the meta device (one whose weights a checkpoint made
    with these adapters will bring) takes them as shapes only."""
    found = adapters(loras)
    if not found:
        return
    names = [f"lora{index}" for index in range(len(found))]
    with _libraries_silent():
        for name, adapter in zip(names, found):
            _load(pipe, adapter, name)
        pipe.set_adapters(names, adapter_weights=[adapter.scale for adapter in found])
        # Every component the family's loader takes (Flux's fuse_lora would fuse the transformer only).
        pipe.fuse_lora(components=list(pipe._lora_loadable_modules), adapter_names=names)
        pipe.unload_lora_weights()


def _load(pipe, adapter: Adapter, name: str) -> None:
    try:
        pipe.load_lora_weights(str(adapter.file.parent), weight_name=adapter.file.name, adapter_name=name)
    except (OSError, RuntimeError, ValueError, KeyError) as error:
        raise UserError(f"{adapter.key}.path={adapter.file} does not fit this model "
                        f"({type(error).__name__}: {_gist(error)}): is it a LoRA for another "
                        "architecture or a corrupt file?") from error
    if not any(name in present for present in pipe.get_list_adapters().values()):
        raise UserError(f"{adapter.key}.path={adapter.file}: none of its weights name a layer of this model's "
                        "UNet or text encoders: is it a LoRA for another architecture?")


def _gist(error: Exception) -> str:
    """An error's message on one line: PyTorch's size-mismatch report names its first mismatch on
    the second line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return " ".join(lines[:2])[:300]
