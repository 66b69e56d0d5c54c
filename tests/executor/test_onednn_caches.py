"""The engine caps oneDNN's and ideep's per-shape caches on CPUs: memory stays bounded when
every iteration has a new number of tokens (the soak's RSS growth, docs/reliability.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from iterserve.executor.device import ONEDNN_CACHE_CAPACITY, bound_onednn_caches

# malloc'd bytes held after bfloat16 linears over 250 token counts (new shapes), in MiB.
_PROBE = """
import ctypes, sys, torch
import torch.nn.functional as F
from iterserve.executor.device import bound_onednn_caches

class MallInfo2(ctypes.Structure):
    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(n, ctypes.c_size_t) for n in names.split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "bounded":
    bound_onednn_caches()
w = torch.randn(1536, 576, dtype=torch.bfloat16)
F.linear(torch.randn(1, 576, dtype=torch.bfloat16), w)
before = libc.mallinfo2().uordblks
for m in range(2, 252):
    F.linear(torch.randn(m, 576, dtype=torch.bfloat16), w)
print((libc.mallinfo2().uordblks - before) / 2**20)
"""


def _held_mib(mode: str) -> float:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
    }
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return float(out.stdout.strip())


def test_new_shapes_do_not_grow_memory_once_bounded() -> None:
    bounded, default = _held_mib("bounded"), _held_mib("default")
    assert bounded < 32, bounded
    # The control: without the bound the caches hold far more (about 0.6 MiB per shape here).
    assert default > 4 * bounded + 64, (bounded, default)


def test_bound_keeps_what_the_environment_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "")  # restored afterwards
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "512")
    assert bound_onednn_caches() == {
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(ONEDNN_CACHE_CAPACITY),
        "LRU_CACHE_CAPACITY": "512",
    }
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(ONEDNN_CACHE_CAPACITY)
