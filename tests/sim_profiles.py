"""Latency profiles with round numbers, for tests whose timestamps are computed by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from iterserve.sim.profile import LatencyProfile


def make_profile(**iteration: float) -> LatencyProfile:
    """A profile whose forward is ``fixed_s`` (10 ms) + 1 ms per decode token + 0.1 ms per
    prefill token, nothing else, unless ``iteration`` overrides a coefficient; no engine
    overhead; 256 blocks of 16 tokens."""
    coefficients: dict[str, Any] = {
        "fixed_s": 0.010,
        "linear_floor_s": 0.0,
        "per_decode_token_s": 0.001,
        "per_prefill_token_s": 0.0001,
        "per_context_token_s": 0.0,
        "per_attention_pair_s": 0.0,
    }
    coefficients.update(iteration)
    return LatencyProfile.model_validate(
        {
            "name": "test-round-numbers",
            "model": {
                "name": "Test-Model",
                "max_model_len": 2048,
                "vocab_size": 1000,
                "eos_token_ids": [2],
            },
            "iteration": coefficients,
            "kv_cache": {"block_size": 16, "num_blocks": 256, "kv_bytes_per_token": 1024},
            "swap": {"bytes_per_s": 1e9},
            "source": {"hardware": "none", "date": "2026-12-01", "method": "written by hand"},
        }
    )


def write_profile(path: Path, profile: LatencyProfile | None = None) -> Path:
    path.write_text((profile or make_profile()).to_json())
    return path
