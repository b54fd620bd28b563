"""Refuses, at a script's start, installed packages the code cannot run on.

Two things are checked: every runtime dependency against the range sdquant declares (pyproject.toml,
read back from the installed package's metadata, so the ranges live in one place), and ModelOpt for
every name the code takes from it, some of them private and so free to move between releases.
"""

from __future__ import annotations

import importlib
from importlib import metadata

from packaging.requirements import Requirement
from packaging.version import InvalidVersion

from .errors import UserError

MODELOPT = "nvidia-modelopt"
# (module, attribute) for everything the code reaches in ModelOpt.
MODELOPT_NAMES = (
    ("modelopt.torch.quantization", "quantize"),
    ("modelopt.torch.quantization", "calibrate"),
    ("modelopt.torch.quantization.calib", "_Calibrator"),
    ("modelopt.torch.quantization.nn", "TensorQuantizer"),
    ("modelopt.torch.opt", "save"),
    ("modelopt.torch.opt", "restore_from_modelopt_state"),
    ("modelopt.torch.opt.conversion", "safe_load"),
)


def declared_requirements() -> list[Requirement]:
    """sdquant's runtime requirements (extras left out) as pip installed them; none when sdquant
    is imported from a checkout that pip has not installed, which declares nothing to check."""
    try:
        lines = metadata.requires("sdquant") or []
    except metadata.PackageNotFoundError:
        return []
    requirements = [Requirement(line) for line in lines]
    return [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]


def installed_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def version_problem(requirement: Requirement, installed: str | None) -> str | None:
    """What is wrong with `installed` for `requirement`, or None. Prereleases count as pip counts
    them for an installed package, so a container's 2.11.0a0+nv torch meets >=2.11.0a0."""
    if installed is None:
        return f"{requirement.name} is not installed, sdquant needs {requirement}"
    try:
        if requirement.specifier.contains(installed, prereleases=True):
            return None
    except InvalidVersion:
        return None  # not a PEP 440 version: nothing can be said about it, pip cannot either
    return f"{requirement.name} {installed} is installed, sdquant needs {requirement}"


def missing_names(names: tuple[tuple[str, str], ...]) -> list[str]:
    """The dotted names among `names` that cannot be imported."""
    missing = []
    for module_name, attribute in names:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(f"{module_name}.{attribute}")
            continue
        if not hasattr(module, attribute):
            missing.append(f"{module_name}.{attribute}")
    return missing


def require_supported(requirements: list[Requirement] | None = None,
                      modelopt_names: tuple[tuple[str, str], ...] = MODELOPT_NAMES) -> None:
    """Raises UserError naming the package, the version found and the version needed."""
    requirements = declared_requirements() if requirements is None else requirements
    problems = [problem for requirement in requirements
                if (problem := version_problem(requirement, installed_version(requirement.name)))]
    if problems:
        raise UserError("; ".join(problems) + ": install a release in range (pip install -e . resolves them all)")
    missing = missing_names(modelopt_names)
    if missing:
        needed = next((str(r) for r in requirements if r.name == MODELOPT), MODELOPT)
        found = installed_version(MODELOPT) or "(not installed)"
        raise UserError(
            f"{MODELOPT} {found} lacks {', '.join(missing)}, which sdquant uses "
            f"(sdquant needs {needed} with these names): install the tested release with "
            "pip install -c constraints.txt -e .")
