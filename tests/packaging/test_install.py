"""The development install (``make install``) as a new user meets it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_a_folder_named_iterserve_beside_a_script_does_not_shadow_the_package(
    tmp_path: Path,
) -> None:
    """A clone in ``./iterserve/`` and a script saved beside it: the script's folder comes first
    on ``sys.path``, where ``iterserve/`` (no ``__init__.py``) is a namespace package. The
    package must still be the installed one: the editable install is a path entry, and a
    regular package anywhere on the path wins over namespace portions (an import hook would
    be asked only after the whole path)."""
    (tmp_path / "iterserve" / "docs").mkdir(parents=True)
    script = tmp_path / "script.py"
    # `from iterserve import LLM` would load torch (seconds); the failure is the same.
    script.write_text(
        "import iterserve\nfrom iterserve import SamplingParams\nprint(iterserve.__file__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).parts[-2:] == ("iterserve", "__init__.py")
