"""The package's shape, checked: functions short enough to read, no import cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80
# Exempt: Triton kernels and their launchers (one kernel per function, as Triton's tutorials
# write them) and the operator's declarative object builders (one Kubernetes object each).
EXEMPT = {"iterserve/kernels/triton_paged_attention.py", "iterserve/operator/builders.py"}


def _long_functions(folder: Path) -> list[str]:
    found = []
    for path in sorted(folder.rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        if name in EXEMPT:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=name)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                num_lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if num_lines > MAX_FUNCTION_LINES:
                    found.append(f"{name}:{node.lineno} {node.name} ({num_lines} lines)")
    return found


def test_no_function_is_longer_than_80_lines() -> None:
    folders = [ROOT / "iterserve", ROOT / "tools"]
    folders += [ROOT / "benchmarks"] if (ROOT / "benchmarks").is_dir() else []
    assert [f for folder in folders for f in _long_functions(folder)] == []


def _cycle(graph: grimp.ImportGraph) -> list[str] | None:
    """One import cycle between the package's modules (depth-first search), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if state.get(imported) == 1:
                return [*path[path.index(imported) :], imported]
            if imported not in state and (found := visit(imported)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph.modules):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_no_import_cycle() -> None:
    """Runtime imports only (``if TYPE_CHECKING:`` blocks are for annotations). A package's
    ``__init__`` re-exporting its modules counts like any module."""
    graph = grimp.build_graph("iterserve", exclude_type_checking_imports=True)
    assert _cycle(graph) is None
