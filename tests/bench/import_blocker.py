"""A ``sys.meta_path`` finder that makes iterserve's own imports of packages the lent GPU
machine lacks fail, as they would there (``python -m benchmarks.gpu``'s import test).

Only imports made by iterserve's code (or ``__main__``) are checked: what torch or
transformers import in turn is theirs, installed with them on that machine.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

# Top-level modules the lent GPU machine has besides the standard library (docs/benchmarks.md).
ALLOWED = frozenset(
    {
        "iterserve",
        "benchmarks",
        "torch",
        "triton",
        "transformers",
        "numpy",
        "safetensors",
        "tokenizers",
        "huggingface_hub",
        "yaml",
        "regex",
        "tqdm",
        "packaging",
        "filelock",
        "fsspec",
        "jinja2",
    }
)


def _importer_name() -> str:
    """``__name__`` of the module whose code runs the import being resolved."""
    frame = sys._getframe(2)
    while frame is not None:
        name = str(frame.f_globals.get("__name__", ""))
        filename = frame.f_code.co_filename
        if not (filename.startswith("<frozen") or name == "importlib" or name == __name__):
            return name
        frame = frame.f_back  # type: ignore[assignment]
    return ""


class ImportBlocker:
    """Raises ImportError for a top-level module outside :data:`ALLOWED` and the standard
    library when iterserve's code (or ``__main__``) imports it; records what it blocked."""

    def __init__(self) -> None:
        self.blocked: list[tuple[str, str]] = []  # (module, importer)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        top = fullname.partition(".")[0]
        if top in ALLOWED or top in sys.stdlib_module_names:
            return None
        importer = _importer_name()
        if importer.partition(".")[0] in ("iterserve", "benchmarks", "__main__"):
            self.blocked.append((fullname, importer))
            raise ImportError(f"{fullname} is not on the lent GPU machine (imported by {importer})")
        return None


def install() -> ImportBlocker:
    """Put a blocker first on ``sys.meta_path`` and return it."""
    blocker = ImportBlocker()
    sys.meta_path.insert(0, blocker)
    return blocker
