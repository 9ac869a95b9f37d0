"""The package's shape, read from its source with `ast` (nothing is imported, no model is loaded).

- No import cycle between modules of `specdecode/`.
- Every import points down the layers (`LAYERS`): a lower layer never imports a higher one.
- No module over `MAX_MODULE_LINES` lines, no function over `MAX_FUNCTION_LINES`.

An import is any `import specdecode...` or `from specdecode... import ...` (or a relative one) anywhere in
a module, inside functions too (a lazy import is still an arrow), except under `if TYPE_CHECKING:`, which
never runs. `from package import name` counts as an import of the submodule `package.name` when that is a
module, else of the package. Importing `a.b.c` also runs `a/__init__.py` and `a/b/__init__.py`; those
implicit arrows are left out, so a package's `__init__` may re-export its modules.

Each check has a list of today's exceptions. A new violation fails the test; so does an exception that
no longer applies (remove it from the list: the lists only shrink).
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "specdecode"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80

# Bottom-up: a module may import its own layer and the ones below. The longest matching prefix decides.
LAYERS: dict[str, int] = {
    "specdecode.errors": 0,
    "specdecode.types": 0,
    "specdecode.paths": 0,
    "specdecode.progress": 0,  # rich's progress bar, which also reaches a log
    "specdecode.devices": 0,  # which device, its clock, counting host synchronisations
    "specdecode.sampling": 0,
    "specdecode.metrics": 0,
    "specdecode.cluster": 0,  # Ray, optional: connecting, a cluster's nodes, jobs pinned to them
    "specdecode.tables": 0,  # rich tables that fit 80 columns: short column names and a legend
    "specdecode.models": 1,
    "specdecode.constraints": 1,  # structured output: grammars and their per-sequence matchers (llguidance)
    "specdecode.verify": 2,
    "specdecode.tree": 2,
    "specdecode.drafters": 3,
    "specdecode.engine": 4,
    "specdecode.methods": 5,
    "specdecode.api": 6,
    "specdecode.bench": 7,
    "specdecode.serve": 7,
    "specdecode.training": 7,
    "specdecode.demo": 7,
    "specdecode.cli": 8,
    "specdecode.__main__": 8,
    "specdecode": 8,  # the package's __init__: the public names, from the API down
}

# Arrows left out of the cycle check, each with the reason it is still there.
KNOWN_CYCLE_EDGES: set[tuple[str, str]] = set()

# Arrows that point up today (importer, imported), each with the reason it is still there.
KNOWN_UPWARD: set[tuple[str, str]] = set()

# Modules and functions over the limits today, by path below the repository and `path::qualified.name`.
KNOWN_LONG_MODULES: set[str] = set()
KNOWN_LONG_FUNCTIONS: set[str] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(node: ast.AST):
    """Every statement below `node`, skipping the bodies of `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for statement in child.orelse:
                yield statement
                yield from _statements(statement)
            continue
        yield child
        yield from _statements(child)


def _known_module(name: str) -> str:
    """`name` or its nearest enclosing module of the package."""
    modules = _modules()
    while name not in modules:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str, path: Path) -> set[str]:
    """The package's modules that `module` imports."""
    modules = _modules()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _statements(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {_known_module(alias.name) for alias in node.names if alias.name.split(".")[0] == "specdecode"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "specdecode":
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in modules else _known_module(source))
    found.discard(module)
    return found


@cache
def import_graph() -> dict[str, frozenset[str]]:
    return {module: frozenset(_imports(module, path)) for module, path in _modules().items()}


def find_cycle(graph: dict[str, frozenset[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, three colours)."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(module: str) -> list[str] | None:
        path.append(module)
        on_path.add(module)
        for imported in sorted(graph.get(module, ())):
            if imported in on_path:
                return path[path.index(imported):] + [imported]
            if imported not in done and (cycle := visit(imported)):
                return cycle
        path.pop()
        on_path.discard(module)
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done and (cycle := visit(module)):
            return cycle
    return None


def layer(module: str) -> int:
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)
    assert prefix is not None, f"{module} has no layer: add it to LAYERS in tests/exact/test_architecture.py"
    return LAYERS[prefix]


def upward_imports(graph: dict[str, frozenset[str]]) -> set[tuple[str, str]]:
    return {(module, imported) for module, imports in graph.items() for imported in imports
            if layer(imported) > layer(module)}


def _sizes() -> tuple[dict[str, int], dict[str, int]]:
    """Lines per module and per function (`path::Class.method`, nested functions named through their parent)."""
    modules: dict[str, int] = {}
    functions: dict[str, int] = {}
    for path in _modules().values():
        source = path.read_text()
        name = path.relative_to(ROOT.parent).as_posix()
        modules[name] = len(source.splitlines())

        def walk(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    qualified = f"{prefix}{child.name}"
                    if not isinstance(child, ast.ClassDef):
                        # (walk is called in this same iteration, so `name` is this module's)
                        functions[f"{name}::{qualified}"] = child.end_lineno - child.lineno + 1  # noqa: B023
                    walk(child, qualified + ".")
                else:
                    walk(child, prefix)

        walk(ast.parse(source, str(path)), "")
    return modules, functions


def test_the_walker_sees_lazy_imports_and_skips_type_checking(tmp_path):
    source = ("from typing import TYPE_CHECKING\nfrom specdecode.types import Draft\nif TYPE_CHECKING:\n"
              "    from specdecode.methods import DrafterOptions\n"
              "def f():\n    from specdecode.engine import loop\n    from . import base\n")
    path = tmp_path / "example.py"  # read as if it were specdecode/drafters/example.py
    path.write_text(source)
    found = _imports("specdecode.drafters.example", path)
    assert found == {"specdecode.types", "specdecode.engine.loop", "specdecode.drafters.base"}


def test_find_cycle_reports_the_cycle():
    graph = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"}), "d": frozenset({"a"})}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": frozenset({"b"}), "b": frozenset()}) is None


def test_no_import_cycles():
    graph = import_graph()
    pruned = {module: imports - {b for a, b in KNOWN_CYCLE_EDGES if a == module} for module, imports in graph.items()}
    cycle = find_cycle(pruned)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    # an exception is stale once putting its arrow back closes no cycle
    stale = {(a, b) for a, b in KNOWN_CYCLE_EDGES
             if b not in graph.get(a, ()) or find_cycle({**pruned, a: pruned[a] | {b}}) is None}
    assert not stale, f"closes no cycle any more, remove from KNOWN_CYCLE_EDGES: {sorted(stale)}"


def test_imports_point_down_the_layers():
    upward = upward_imports(import_graph())
    new = upward - KNOWN_UPWARD
    assert not new, "a lower layer imports a higher one (see LAYERS):\n" + "\n".join(
        f"  {a} (layer {layer(a)}) -> {b} (layer {layer(b)})" for a, b in sorted(new))
    stale = KNOWN_UPWARD - upward
    assert not stale, f"no longer upward, remove from KNOWN_UPWARD: {sorted(stale)}"


def test_modules_and_functions_are_short():
    modules, functions = _sizes()
    long_modules = {name for name, lines in modules.items() if lines > MAX_MODULE_LINES}
    long_functions = {name for name, lines in functions.items() if lines > MAX_FUNCTION_LINES}
    new = sorted((long_modules - KNOWN_LONG_MODULES) | (long_functions - KNOWN_LONG_FUNCTIONS))
    assert not new, f"over {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_LINES} a function: " + ", ".join(
        f"{name} ({modules.get(name) or functions.get(name)})" for name in new)
    stale = sorted((KNOWN_LONG_MODULES - long_modules) | (KNOWN_LONG_FUNCTIONS - long_functions))
    assert not stale, f"no longer too long, remove from the KNOWN_LONG_ lists: {stale}"


def test_no_test_skips_when_the_package_fails_to_import():
    """`pytest.importorskip` turns a missing optional dependency into a skip; on the package's own modules it would
    turn an import regression into one. Its own modules are imported, never skipped on."""
    tests = ROOT.parent / "tests"
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip" and node.args
                    and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("specdecode")):
                found.append(f"{path.relative_to(tests)}:{node.lineno}")
    assert not found, f"importorskip on the package's own modules: {found}"
