"""Imports go app → runtime → models → ext, never upward (ARCHITECTURE.md), and always through
the installed package (`tandem.runtime`, never a bare top-level `runtime`).

Imports under `if TYPE_CHECKING:` are exempt. `app` also stays free of tensors: no torch.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"ext": 0, "models": 1, "runtime": 2, "app": 3}
FORBIDDEN_IN = {"app": {"torch", "cupy"}}


def _layer(module: str) -> str:
    """`tandem.runtime.engine` -> `runtime`; a bare `runtime.engine` -> `bare runtime`."""
    parts = module.split(".")
    if parts[0] == "tandem" and len(parts) > 1:
        return parts[1]
    return f"bare {parts[0]}" if parts[0] in LAYERS else parts[0]


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, type_checking: bool) -> None:
        if isinstance(node, ast.If):
            test = node.test
            is_tc = (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
            )
            for child in node.body:
                visit(child, type_checking or is_tc)
            for child in node.orelse:
                visit(child, type_checking)
            return
        if not type_checking:
            if isinstance(node, ast.Import):
                found.extend((node.lineno, _layer(a.name)) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.append((node.lineno, _layer(node.module)))
        for child in ast.iter_child_nodes(node):
            visit(child, type_checking)

    visit(tree, False)
    return found


def _modules() -> list[Path]:
    return sorted(p for pkg in LAYERS for p in (ROOT / pkg).rglob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_upward_imports(path: Path) -> None:
    pkg = path.relative_to(ROOT).parts[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for lineno, top in _imports(tree):
        if top in LAYERS and LAYERS[top] > LAYERS[pkg]:
            bad.append(f"line {lineno}: {pkg} imports {top}")
        if top.startswith("bare "):
            bad.append(f"line {lineno}: {top.split()[1]} imported outside the tandem package")
        if top in FORBIDDEN_IN.get(pkg, set()):
            bad.append(f"line {lineno}: {pkg} imports {top}")
    assert not bad, f"{path.relative_to(ROOT)}: " + "; ".join(bad)


def test_the_checker_catches_an_upward_import() -> None:
    tree = ast.parse(
        "import os\nfrom tandem.runtime.engine import Engine\nimport models.x\n"
        "if TYPE_CHECKING:\n    import tandem.app\n"
    )
    assert _imports(tree) == [(1, "os"), (2, "runtime"), (3, "bare models")]


@pytest.mark.parametrize("folder", ["tests", "tools"])
def test_tests_and_tools_import_through_the_package(folder: str) -> None:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        bad += [
            f"{path.relative_to(ROOT)}:{lineno}"
            for lineno, top in _imports(tree)
            if top.startswith("bare ")
        ]
    assert not bad, "bare top-level imports (use tandem.*): " + ", ".join(bad)
