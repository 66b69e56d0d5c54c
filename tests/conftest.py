"""Shared fixtures: one float32 copy of the real default model for the whole session."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import SHARED_NUM_KV_BLOCKS

from iterserve.config import EngineConfig


@pytest.fixture(scope="session")
def loaded_f32() -> Any:
    """The default model loaded once in float32 (parity with Hugging Face is tested there)."""
    from iterserve.executor.build import build

    return build(EngineConfig.from_kwargs(dtype="float32", num_kv_blocks=SHARED_NUM_KV_BLOCKS))
