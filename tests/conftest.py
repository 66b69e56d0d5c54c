"""Shared fixtures: one float32 copy of the real default model for the whole session, and the
``device`` the device-neutral executor tests run on (CUDA when present, else the CPU).

Without a CUDA device the Triton kernels run under Triton's interpreter (on the CPU):
``TRITON_INTERPRET=1`` is set here, before any test imports triton (``@triton.jit`` reads it
when it decorates a kernel), so CI needs nothing else. With one they compile for the GPU
(unless ``TRITON_INTERPRET`` is set explicitly).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from helpers import SHARED_NUM_KV_BLOCKS

from iterserve.config import EngineConfig

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> torch.device:
    """CUDA when present, else the CPU (as the engine's own choice, ``select_device``)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@pytest.fixture(scope="session")
def loaded_f32() -> Any:
    """The default model loaded once in float32 (parity with Hugging Face is tested there)."""
    from iterserve.executor.build import build

    # A small host pool too (swap tests): 0.05 GiB = 72 float32 blocks of 16 tokens.
    config = EngineConfig.from_kwargs(
        dtype="float32", num_kv_blocks=SHARED_NUM_KV_BLOCKS, swap_space=0.05
    )
    return build(config)
