"""The import graph of tandem.models has no cycles, and every one of its modules imports on its
own in a fresh interpreter (no module relies on another having been imported first).

Edges are every import in a module's source, lazy ones inside functions included (a lazy
import is still a dependency; it only hides a circle from the interpreter), except imports
under `if TYPE_CHECKING:`. `from pkg import name` counts as an edge to `pkg.name` when that is a
module, else to `pkg`.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "models"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["tandem", *parts])


def _all_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(source: str, own: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that module `own` (its `source`) imports (see the docstring)."""
    found: set[str] = set()
    package = own if is_package else own.rpartition(".")[0]

    def add(module: str, names: list[str]) -> None:
        for name in names:
            if f"{module}.{name}" in known:
                found.add(f"{module}.{name}")
            elif module in known:
                found.add(module)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            add(module, [a.name for a in node.names])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    found.discard(own)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = dfs(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = dfs(node)
            if cycle:
                return cycle
    return None


def test_find_cycle_sees_a_circle_through_a_lazy_import() -> None:
    """The checker itself: a function-level import closing a circle is found."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    src = "def f():\n    import tandem.models.x\nif TYPE_CHECKING:\n    import q\n"
    assert imports_of(src, "tandem.models.m", False, {"tandem.models.x", "q"}) == {
        "tandem.models.x"
    }
    relative = "from .x import y\nfrom . import z\n"
    known = {"tandem.models.x", "tandem.models.z"}
    assert imports_of(relative, "tandem.models.m", False, known) == known


def test_models_import_graph_has_no_cycles() -> None:
    modules = _all_modules()
    known = set(modules)
    graph = {
        name: imports_of(path.read_text(), name, path.name == "__init__.py", known)
        for name, path in modules.items()
    }
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


_IMPORT_EACH = """
import os, sys
import torch  # the heavy common dependency, once; no tandem module is loaded before a fork
failed = []
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            __import__(name)
        except BaseException as e:
            print(f"{name}: {type(e).__name__}: {e}", flush=True)
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status:
        failed.append(name)
sys.exit(1 if failed else 0)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_each_models_module_imports_alone() -> None:
    names = sorted(_all_modules())
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, *names], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
