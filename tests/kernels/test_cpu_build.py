"""Building and loading the C kernels: a damaged cache file is rebuilt, a broken compiler
means plain torch (with a warning), never a crash. Each case in a fresh process, since the
library is loaded once per process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

LOAD = (
    "import logging; logging.basicConfig(level=logging.INFO)\n"
    "from iterserve.kernels.cpu_build import load_cpu_kernels\n"
    "print('loaded' if load_cpu_kernels() is not None else 'unavailable')\n"
)


def run(cache_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = os.environ | {"ITERSERVE_CACHE_DIR": str(cache_dir)} | env
    return subprocess.run(
        [sys.executable, "-c", LOAD], env=full_env, capture_output=True, text=True, timeout=300
    )


def test_build_then_reuse_then_rebuild_a_damaged_file(tmp_path: Path) -> None:
    first = run(tmp_path)
    assert first.stdout.strip() == "loaded", first.stderr
    assert "building the CPU kernels" in first.stderr
    (so,) = (tmp_path / "kernels").glob("*.so")
    second = run(tmp_path)
    assert second.stdout.strip() == "loaded" and "building" not in second.stderr
    so.write_bytes(b"not a shared library")
    third = run(tmp_path)
    assert third.stdout.strip() == "loaded", third.stderr
    assert "rebuilding" in third.stderr
    assert so.stat().st_size > 1000


@pytest.mark.parametrize("compiler", ["/bin/false", "/nonexistent/cc"])
def test_a_broken_compiler_means_plain_torch(tmp_path: Path, compiler: str) -> None:
    result = run(tmp_path, CC=compiler)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "unavailable"
    assert "using plain torch" in result.stderr
