"""The package's modules import one another without a circle, counting imports inside functions
too: a module that needs another only at call time still depends on it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "sdquant"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The package modules one import statement names."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    if not isinstance(node, ast.ImportFrom):
        return set()
    if node.level:
        parts = module.split(".")
        base = parts[:len(parts) - node.level + (1 if is_package else 0)]
        parent = ".".join(base + ([node.module] if node.module else []))
    else:
        parent = node.module or ""
    found = {f"{parent}.{alias.name}" for alias in node.names if f"{parent}.{alias.name}" in known}
    return found or ({parent} if parent in known else set())


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    known = set(files)
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text())
        is_package = path.name == "__init__.py"
        graph[module] = {name for node in ast.walk(tree) for name in _imported(node, module, is_package, known)
                         if name != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports, as the modules along it, or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for name in sorted(graph[module]):
            if state.get(name) == "open":
                return path[path.index(name):] + [name]
            if name not in state and (cycle := visit(name)):
                return cycle
        state[module] = "done"
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_the_checker_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert "sdquant.errors" in graph["sdquant.config"], "the checker reads the package's imports"
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


# The package's floors, from the ground up: a module imports only modules on its own floor or below
# (docs/architecture.md: "Where the code is"). The graph vocabulary stands below everything that describes,
# exports or runs a graph; the families stand on the stages they describe themselves with.
LAYERS = (
    # The package's face holds only its version and a warnings filter.
    ("sdquant", "sdquant.errors", "sdquant.interrupts", "sdquant.progress"),
    ("sdquant.artifacts", "sdquant.environment", "sdquant.parallel", "sdquant.cuda_graphs", "sdquant.config",
     "sdquant.lora", "sdquant.cli", "sdquant.graphs"),
    ("sdquant.quantize",),
    ("sdquant.export",),
    ("sdquant.runtime",),
    ("sdquant.families",),
    ("sdquant.load", "sdquant.report"),
    # Each script's config settled, then the pipeline built once from it, then the Python API.
    ("sdquant.runs",),
    ("sdquant.assembly",),
    ("sdquant.api", "sdquant.quality"),
    # The server: request checks and batching over the settled call, replicas built by the API.
    ("sdquant.serving",),
    ("sdquant.workflow",),
)


def floor(module: str) -> int:
    """The floor of `module`: that of the longest prefix LAYERS names."""
    best = max((prefix for layer in LAYERS for prefix in layer
                 if module == prefix or (module.startswith(prefix + ".") and prefix != "sdquant")), key=len)
    return next(index for index, layer in enumerate(LAYERS) if best in layer)


def test_no_import_runs_back_up():
    graph = import_graph()
    upward = sorted(f"{module} -> {name}" for module, names in graph.items() for name in names
                    if floor(name) > floor(module))
    assert floor("sdquant.families.flux") > floor("sdquant.graphs.networks"), "the floors are read"
    assert not upward, "imports that run back up a floor: " + "; ".join(upward)
