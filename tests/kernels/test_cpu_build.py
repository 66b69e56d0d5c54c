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
    size = so.stat().st_size
    for damage in (b"not a shared library", so.read_bytes()[:4096], so.read_bytes()[: size // 2]):
        # Garbage fails dlopen; a truncated library passes it and would die of SIGBUS later.
        so.write_bytes(damage)
        again = run(tmp_path)
        assert again.returncode == 0 and again.stdout.strip() == "loaded", again.stderr
        assert "rebuilding" in again.stderr
        assert so.stat().st_size == size


@pytest.mark.parametrize("compiler", ["/bin/false", "/nonexistent/cc"])
def test_a_broken_compiler_means_plain_torch(tmp_path: Path, compiler: str) -> None:
    result = run(tmp_path, CC=compiler)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "unavailable"
    assert "using plain torch" in result.stderr


@pytest.mark.model
def test_the_torch_backend_never_loads_the_kernels(tmp_path: Path) -> None:
    """``--attention-backend torch`` is the plain-torch baseline: greedy sampling included."""
    script = (
        "from iterserve import LLM, SamplingParams\n"
        "from iterserve.kernels.cpu_build import load_cpu_kernels\n"
        "llm = LLM(dtype='bfloat16', attention_backend='torch', num_kv_blocks=16)\n"
        "out = llm.generate(['Hello'], SamplingParams(max_tokens=4, temperature=0.0))\n"
        "assert len(out[0].outputs[0].token_ids) == 4\n"
        "print('calls', load_cpu_kernels.cache_info().currsize)\n"
    )
    env = dict(os.environ)
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("calls 0")
