"""Reporting stage: library versions for provenance and the closing summary of every script."""

from __future__ import annotations

import platform
from importlib import metadata
from pathlib import Path

PROVENANCE_PACKAGES = ("torch", "diffusers", "transformers", "nvidia-modelopt", "onnx",
                       "onnxruntime", "tensorrt", "tensorrt-rtx-cu13")


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for package in PROVENANCE_PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return versions


def _size(path: Path) -> str:
    size = path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return ""


def print_summary(title: str, written: list[Path], seconds: float, reused: list[Path] = ()) -> None:
    print(f"\n{title} finished in {seconds:.1f} s")
    for path in written:
        print(f"  wrote   {path}  ({_size(path)})")
    for path in reused:
        print(f"  reused  {path}  (force=true rebuilds it)")


def print_engine_table(record: dict) -> None:
    """One line per engine: its batch range, inputs and size."""
    if not record:
        return
    print(f"\n{'engine':<10} {'batch min/opt/max':<18} {'MB':>8}  inputs")
    for name, info in record.items():
        inputs = info.get("inputs", {})
        profiles = [spec["profile"] for spec in inputs.values() if "profile" in spec]
        batch = "/".join(str(p[0]) for p in profiles[0]) if profiles else "?"
        size = f"{info['bytes'] / 1024**2:.1f}" if "bytes" in info else "-"
        dtypes = ", ".join(f"{n}:{spec.get('dtype', '?')}" for n, spec in inputs.items())
        print(f"{name:<10} {batch:<18} {size:>8}  {dtypes}")
