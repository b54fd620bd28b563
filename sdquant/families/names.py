"""The config's names for the model families (model.family), apart from the families themselves so
that the config schema can name them without importing any family."""

from __future__ import annotations

from enum import Enum


class Family(str, Enum):
    sdxl = "sdxl"
    sd15 = "sd15"
    sd2 = "sd2"
    flux = "flux"
    sd3 = "sd3"
