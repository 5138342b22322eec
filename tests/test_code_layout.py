"""The package's shape, kept: no import circles, no module over 400 lines, no function over 60 lines.

Read from the source with `ast`. Every import is an edge: at module level, inside a function, or
under `if TYPE_CHECKING:` (a circle broken by a late import, or hidden behind a type's name, is
still a circle in the design). CONTRIBUTING.md says how to keep the layout.
"""

from __future__ import annotations

import ast
from pathlib import Path

import anatomist

PACKAGE = Path(anatomist.__file__).parent
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400
LAYERS = (
    ("errors", "anatomy", "axes", "hardware", "data", "op_classes", "user_cache", "config_fields", "token_stats",
     "trainer_defaults", "deepspeed_bounds", "model_catalog", "envinfo"),
    ("recipe", "workload", "model_config", "model_facts"),
    ("trace",),
    ("workload_loader",),
    ("calibration", "estimate"),
    ("plan", "measure", "bench", "report", "recipe_labels"),
    ("cli", "web", "__main__"),
)
"""The package's layers, lowest first (CONTRIBUTING.md): a module imports from its own layer or a lower one."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m in known and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_no_import_circles() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == []


def _layer(module: str) -> int | None:
    top = module.split(".")[1] if "." in module else None
    return next((i for i, names in enumerate(LAYERS) if top in names), None)


def test_every_module_has_a_layer_and_imports_none_above_it() -> None:
    modules = _modules()
    unplaced = [name for name in modules if name != "anatomist" and _layer(name) is None]
    upward = [f"{name} -> {imported}" for name, path in modules.items() if name != "anatomist"
              for imported in _imports(name, path, modules)
              if imported != "anatomist" and _layer(imported) > _layer(name)]  # type: ignore[operator]
    assert (unplaced, upward) == ([], [])


def test_the_cycle_finder_finds_one() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_long_function() -> None:
    long = []
    for name, path in sorted(_modules().items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_no_long_module() -> None:
    long = [f"{name} ({lines} lines)" for name, path in sorted(_modules().items())
            if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    assert long == []
