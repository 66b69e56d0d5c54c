"""The package's shape, checked: functions short enough to read (import cycles and the one
engine factory: tests/test_composition.py)."""

from __future__ import annotations

import ast
from pathlib import Path

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
