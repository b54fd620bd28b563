"""The geometry of one sample a pipeline draws, settled once from a script's settings and handed to
every stage that sizes something by it: graph traces, engine profiles, latents, decoding, writers
and scores."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SampleGeometry:
    """Frames (1 for an image), height and width in pixels."""

    frames: int
    height: int
    width: int

    def describe(self) -> str:
        size = f"{self.width}x{self.height}"
        return size if self.frames == 1 else f"{self.frames} frames of {size}"
