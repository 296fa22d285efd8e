"""The import graph: layers point down, modules form no cycles, the server sees only the engine.

DESIGN.md's layering (runtime < memory < agent < tui, no cycles) checked on the source with
``ast``, nothing executed. Every import counts, wherever it is written: at the top, inside a
function (a late import is still a dependency) and under ``if TYPE_CHECKING:`` (a cycle hidden
there is still a cycle in the design, and a type checker follows it). Relative imports are
resolved; ``from pkg import name`` is an import of the submodule ``pkg.name`` when that is a
module, else of ``pkg`` itself (its ``__init__``). Imports named by a string
(``importlib.import_module``) are not seen.

The rules:

- no cycle between modules;
- a lower layer never imports a higher one, but for the CLI's ``chat`` command starting the
  TUI (a module of ``agent.cli`` importing ``tui.app``);
- ``runtime.serve`` imports nothing of ``runtime`` but itself, ``runtime.engine`` and
  ``runtime.errors``: the server depends on the engine only;
- no module imports the ``__init__`` of a package that contains it (``from runtime.engine
  import Engine`` inside ``runtime/engine/``, ``from runtime import X`` inside ``runtime/``):
  a package's ``__init__`` is its face to the outside, and importing it from inside is how
  cycles through ``__init__`` start. A package's ``__init__`` importing its own submodules is
  fine.
"""

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("runtime", "memory", "agent", "tui")  # lowest first
UPWARD_ALLOWED = (("agent.cli.", "tui.app"),)  # (importer's prefix, imported module)
SERVE = "runtime.serve"
SERVE_MAY_IMPORT = ("runtime.serve", "runtime.engine", "runtime.errors")  # each with its submodules


@dataclass(frozen=True, slots=True)
class Import:
    """One import of a project module: who imports what, and where it is written."""

    source: str
    target: str
    path: str  # the importer's file, relative to the tree's root
    line: int
    statement: str  # as written, one name per import: "from runtime.engine import Engine"

    def where(self) -> str:
        return f"{self.path}:{self.line}: {self.statement}"


@dataclass(frozen=True, slots=True)
class ImportGraph:
    modules: dict[str, bool]  # module name -> whether it is a package (an __init__.py)
    imports: tuple[Import, ...]

    def first_edges(self) -> dict[str, dict[str, Import]]:
        """source -> target -> the first import of target written in source (self-imports left out)."""
        edges: dict[str, dict[str, Import]] = {name: {} for name in self.modules}
        for imp in sorted(self.imports, key=lambda i: (i.source, i.line)):
            if imp.target != imp.source:
                edges[imp.source].setdefault(imp.target, imp)
        return edges


def read_graph(root: Path, top_packages: tuple[str, ...] = LAYERS) -> ImportGraph:
    """Every module of ``top_packages`` under ``root`` and every import of one of them."""
    files: dict[str, Path] = {}
    modules: dict[str, bool] = {}
    for top in top_packages:
        for file in sorted((root / top).rglob("*.py")):
            parts = list(file.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            name = ".".join(parts)
            files[name] = file
            modules[name] = is_package
    imports: list[Import] = []
    for name, file in files.items():
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target, statement in _imported(node, name, modules, top_packages):
                path = file.relative_to(root).as_posix()
                imports.append(Import(name, target, path, node.lineno, statement))
    return ImportGraph(modules, tuple(imports))


def _imported(
    node: ast.Import | ast.ImportFrom, module: str, modules: dict[str, bool], top_packages: tuple[str, ...]
) -> list[tuple[str, str]]:
    """(imported project module, the statement for one name) for each name ``node`` imports."""
    found: list[tuple[str, str]] = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            target = _known(alias.name, modules, top_packages)
            if target is not None:
                found.append((target, f"import {alias.name}"))
    else:
        base = _absolute(node, module, modules[module])
        written = "." * node.level + (node.module or "")
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            target = submodule if submodule in modules else _known(base, modules, top_packages)
            if target is not None:
                found.append((target, f"from {written} import {alias.name}"))
    return found


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    if node.level - 1 >= len(package):
        raise ValueError(f"{module}: relative import beyond the top package (level {node.level})")
    parts = package[: len(package) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _known(name: str, modules: dict[str, bool], top_packages: tuple[str, ...]) -> str | None:
    """The project module ``name`` loads: itself, or its longest prefix that is a module."""
    if name.split(".")[0] not in top_packages:
        return None
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or None


# -- the rules --------------------------------------------------------------------------------


def cycles(graph: ImportGraph) -> list[str]:
    """One report per group of modules that import each other, with one cycle's path spelled out."""
    edges = graph.first_edges()
    reach = {name: _reachable(name, edges) for name in edges}
    reports: list[str] = []
    seen: set[str] = set()
    for name in sorted(edges):
        if name in seen or name not in reach[name]:
            continue
        group = {other for other in reach[name] if name in reach[other]} | {name}
        seen |= group
        path = _shortest_cycle(name, edges, group)
        lines = [f"cycle: {' -> '.join([imp.source for imp in path] + [name])}"]
        lines += [f"    {imp.where()}" for imp in path]
        if len(group) > len(path):
            lines.append(f"    (part of a knot of {len(group)} modules: {', '.join(sorted(group))})")
        reports.append("\n".join(lines))
    return reports


def _reachable(start: str, edges: dict[str, dict[str, Import]]) -> set[str]:
    found: set[str] = set()
    stack = list(edges[start])
    while stack:
        name = stack.pop()
        if name not in found:
            found.add(name)
            stack.extend(edges.get(name, {}))
    return found


def _shortest_cycle(start: str, edges: dict[str, dict[str, Import]], group: set[str]) -> list[Import]:
    """The imports of a shortest path from ``start`` back to itself, inside ``group``."""
    came_by: dict[str, Import] = {}
    queue = deque([start])
    while queue:
        name = queue.popleft()
        for target, imp in sorted(edges[name].items()):
            if target not in group:
                continue
            if target == start:
                path = [imp]
                while path[0].source != start:
                    path.insert(0, came_by[path[0].source])
                return path
            if target not in came_by:
                came_by[target] = imp
                queue.append(target)
    raise AssertionError(f"{start} is in a cycle but no path leads back to it")


def upward_imports(graph: ImportGraph) -> list[str]:
    """Imports of a higher layer (runtime < memory < agent < tui) from a lower one."""
    found = []
    for imp in graph.imports:
        lower, higher = _layer(imp.source), _layer(imp.target)
        allowed = any(
            imp.source.startswith(prefix) and imp.target == target for prefix, target in UPWARD_ALLOWED
        )
        if higher > lower and not allowed:
            found.append(f"{LAYERS[lower]} imports {LAYERS[higher]}: {imp.where()}")
    return sorted(found)


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def serve_beyond_engine(graph: ImportGraph) -> list[str]:
    """Imports of ``runtime`` from ``runtime.serve`` other than the engine's and the errors."""
    found = []
    for imp in graph.imports:
        if not _within(imp.source, SERVE) or not _within(imp.target, "runtime"):
            continue
        if not any(_within(imp.target, allowed) for allowed in SERVE_MAY_IMPORT):
            found.append(f"{SERVE} imports {imp.target} (only {', '.join(SERVE_MAY_IMPORT)}): {imp.where()}")
    return sorted(found)


def own_package_imports(graph: ImportGraph) -> list[str]:
    """Imports of an enclosing package's ``__init__`` from a module inside that package."""
    return sorted(
        f"{imp.source} imports its own package {imp.target}'s __init__: {imp.where()}"
        for imp in graph.imports
        if graph.modules[imp.target] and imp.source.startswith(imp.target + ".")
    )


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


# -- the project --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return read_graph(ROOT)


def _fail_on(problems: list[str], what: str) -> None:
    assert not problems, f"{len(problems)} {what}:\n" + "\n".join(problems)


def test_the_walker_sees_the_whole_tree(graph: ImportGraph) -> None:
    assert len(graph.modules) > 60
    assert {"runtime", "memory", "agent", "tui", "runtime.serve.server", "tui.app"} <= set(graph.modules)
    edges = {(imp.source, imp.target) for imp in graph.imports}
    # A TYPE_CHECKING import, and a from-import of a package resolved to the module it names.
    assert ("runtime.serve.server", "runtime.engine.engine") in edges
    assert ("tui.screens.chat", "tui.commands") in edges


def test_no_import_cycles(graph: ImportGraph) -> None:
    _fail_on(cycles(graph), "import cycle(s)")


def test_layers_import_only_downward(graph: ImportGraph) -> None:
    _fail_on(upward_imports(graph), "upward import(s) (runtime < memory < agent < tui)")


def test_serve_depends_on_the_engine_only(graph: ImportGraph) -> None:
    _fail_on(serve_beyond_engine(graph), "import(s) from runtime.serve beyond the engine")


def test_no_module_imports_its_own_package(graph: ImportGraph) -> None:
    _fail_on(own_package_imports(graph), "import(s) of an enclosing package's __init__")


# -- the checker itself -----------------------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_finds_what_it_is_for(tmp_path: Path) -> None:
    """A synthetic tree with one of each problem, hidden where imports hide: each is reported."""
    _write(
        tmp_path,
        {
            "runtime/__init__.py": "from runtime import b\n",  # its own submodule: fine
            "runtime/a.py": "from runtime.b import thing\n",
            "runtime/b.py": "def late():\n    from . import a\n",  # closes a -> b -> a
            "runtime/c.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from agent.x import Y\n"
            ),
            "runtime/kv/__init__.py": "",
            "runtime/kv/cache.py": "from runtime import Engine\n",  # the parent package's __init__
            "runtime/serve/__init__.py": "",
            "runtime/serve/server.py": "from ..kv import cache\nfrom runtime.engine import x\n",
            "runtime/engine/__init__.py": "",
            "agent/__init__.py": "",
            "agent/x.py": "import tui.app\n",
            "agent/cli/__init__.py": "",
            "agent/cli/chat.py": "def run():\n    from tui.app import run_chat\n",  # the allowed one
            "tui/__init__.py": "",
            "tui/app.py": "import agent.x\n",
        },
    )
    graph = read_graph(tmp_path)
    assert len(graph.modules) == 15

    found = cycles(graph)
    assert len(found) == 2, found
    assert found[0].startswith("cycle: agent.x -> tui.app -> agent.x")
    assert found[1].startswith("cycle: runtime.a -> runtime.b -> runtime.a")
    assert "runtime/b.py:2: from . import a" in found[1]

    upward = upward_imports(graph)
    assert len(upward) == 2, upward
    assert upward[0].startswith("agent imports tui: agent/x.py:1: import tui.app")
    assert upward[1] == "runtime imports agent: runtime/c.py:3: from agent.x import Y"

    assert serve_beyond_engine(graph) == [
        "runtime.serve imports runtime.kv.cache (only runtime.serve, runtime.engine, runtime.errors): "
        "runtime/serve/server.py:1: from ..kv import cache"
    ]
    assert own_package_imports(graph) == [
        "runtime.kv.cache imports its own package runtime's __init__: "
        "runtime/kv/cache.py:1: from runtime import Engine"
    ]
