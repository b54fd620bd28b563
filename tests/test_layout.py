"""A family is one place: the stages ask `family_of(model.family)` for everything family-specific, so
adding a family never edits a stage. These tests read the stage modules' code (not their comments)
and hold them to that."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sdquant.families import all_families, family_names

ROOT = Path(__file__).resolve().parents[1]
STAGE_DIRS = ("quantize", "export", "runtime", "workflow", "quality")
# The families' shared vocabulary, which every stage may use; any other module or package under
# families/ is family knowledge: one family's own, or what some families share (dit.py).
SHARED_FAMILY_MODULES = {"base", "pipeline", "training", "components", "encoders"}


def stage_modules() -> list[Path]:
    files = [p for d in STAGE_DIRS for p in sorted((ROOT / "sdquant" / d).rglob("*.py"))]
    return files + sorted(ROOT.glob("*.py"))


def imported_family_modules(tree: ast.AST) -> set[str]:
    """The modules under sdquant.families that `tree` imports, by their name in that package."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and "families" in node.module.split("."):
            parts = node.module.split(".")
            below = parts[parts.index("families") + 1:]
            if below:
                names.add(below[0])
            else:
                names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if "families" in parts and parts.index("families") + 1 < len(parts):
                    names.add(parts[parts.index("families") + 1])
    return names


def code_strings(tree: ast.AST) -> list[str]:
    """String constants in code, leaving out docstrings (which may name a family as an example)."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_the_stage_modules_are_where_the_layout_says():
    assert len(stage_modules()) > 20
    for d in STAGE_DIRS:
        assert (ROOT / "sdquant" / d / "__init__.py").exists(), d


@pytest.mark.parametrize("path", stage_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_stage_imports_one_family(path):
    families = ROOT / "sdquant" / "families"
    family_modules = {p.stem for p in families.glob("*.py")} | {p.parent.name for p in families.glob("*/__init__.py")}
    family_modules -= SHARED_FAMILY_MODULES | {"__init__"}
    assert "wan" in family_modules, "a family's package counts as its module"
    assert family_modules, "the families package has no family module"
    tree = ast.parse(path.read_text(), str(path))
    allowed = SHARED_FAMILY_MODULES | {"family_of", "all_families", "scene_family", "ModelFamily"}
    imported = imported_family_modules(tree)
    assert not imported & family_modules, f"{path.name} imports a family: {imported & family_modules}"
    assert imported <= allowed, f"{path.name} imports {imported - allowed} from sdquant.families"


@pytest.mark.parametrize("path", stage_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_stage_tests_a_family_name(path):
    names = set(family_names())
    strings = code_strings(ast.parse(path.read_text(), str(path)))
    assert not names & set(strings), f"{path.name} names a family in its code: {names & set(strings)}"


def test_each_family_is_registered_under_a_name():
    families = all_families()
    assert len(families) >= 3
    described = {f.__class__.__name__ for f in families}
    assert len(described) == len(families), "two registered families share a class"
