"""The package is composed in one place: the engine is built only by the engine factory, and
no module imports itself back through others (no import cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
FACTORY = ROOT / "iterserve" / "engine" / "factory.py"


def _constructions(path: Path) -> list[int]:
    """Lines of ``path`` that call ``LLMEngine(...)`` (by name or as an attribute)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name == "LLMEngine":
                lines.append(node.lineno)
    return lines


def test_only_the_factory_constructs_the_engine() -> None:
    folders = [ROOT / "iterserve", ROOT / "benchmarks"]
    found = {
        f"{path.relative_to(ROOT)}:{line}"
        for folder in folders
        if folder.is_dir()
        for path in folder.rglob("*.py")
        if path != FACTORY
        for line in _constructions(path)
    }
    assert not found, f"LLMEngine(...) outside iterserve/engine/factory.py: {sorted(found)}"
    assert _constructions(FACTORY), "the factory no longer constructs the engine"


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycle() -> None:
    # Imports inside functions count too: a lazy import still ties the two modules together.
    assert _cycles(grimp.build_graph("iterserve")) == []
