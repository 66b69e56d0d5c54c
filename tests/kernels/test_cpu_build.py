"""Building and loading the C kernels: a damaged cache file is rebuilt, a broken compiler
means plain torch (with a warning), never a crash. Each case in a fresh process, since the
library is loaded once per process."""

from __future__ import annotations

import hashlib
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
    sidecar = so.with_name(so.name + ".sha256")
    second = run(tmp_path)
    assert second.stdout.strip() == "loaded" and "building" not in second.stderr
    original = so.read_bytes()
    size = len(original)
    # Same size, bytes flipped mid-file (in the code): dlopen and the size cannot tell.
    flipped = bytearray(original)
    flipped[size // 2 : size // 2 + 64] = bytes(
        b ^ 0xFF for b in flipped[size // 2 : size // 2 + 64]
    )
    # The two damages dlopen cannot tell (garbage fails dlopen anyway; each rebuild costs a
    # compile, so the suite checks only these): a truncated library passes it and would die
    # of SIGBUS later; flipped bytes load and run wrong code. The sha256 sidecar catches both.
    damages = [original[: size // 2], bytes(flipped)]
    assert len(damages[-1]) == size and damages[-1] != original
    for damage in damages:
        so.write_bytes(damage)
        again = run(tmp_path)
        assert again.returncode == 0 and again.stdout.strip() == "loaded", again.stderr
        assert f"{so} is damaged or incomplete; rebuilding" in again.stderr
        rebuilt = so.read_bytes()
        assert len(rebuilt) == size and rebuilt != damage
        assert hashlib.sha256(rebuilt).hexdigest() == sidecar.read_text().strip()


@pytest.mark.parametrize("compiler", ["/bin/false", "/nonexistent/cc"])
def test_a_broken_compiler_means_plain_torch(tmp_path: Path, compiler: str) -> None:
    result = run(tmp_path, CC=compiler)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "unavailable"
    assert "using plain torch" in result.stderr


def test_the_torch_platform_is_chosen_without_loading_the_kernels() -> None:
    script = (
        "import torch\n"
        "from iterserve.kernels.cpu_build import load_cpu_kernels\n"
        "from iterserve.kernels.platform import select_platform\n"
        "platform = select_platform('torch', torch.device('cpu'), torch.bfloat16)\n"
        "print(type(platform).__name__, 'calls', load_cpu_kernels.cache_info().currsize)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "TorchPlatform calls 0"


@pytest.mark.model
def test_the_torch_backend_never_loads_the_kernels(tmp_path: Path) -> None:
    """``--attention-backend torch`` is the plain-torch baseline: one TorchPlatform for the
    model, the attention and the sampler, greedy sampling included."""
    script = (
        "from iterserve import LLM, SamplingParams\n"
        "from iterserve.kernels.cpu_build import load_cpu_kernels\n"
        "from iterserve.kernels.platform import TorchPlatform\n"
        "llm = LLM(dtype='bfloat16', attention_backend='torch', num_kv_blocks=16)\n"
        "runner = llm.loaded.runner\n"
        "assert isinstance(llm.loaded.platform, TorchPlatform)\n"
        "assert runner.platform is runner.model.platform is runner.sampler.platform\n"
        "assert runner.platform is llm.loaded.platform\n"
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
