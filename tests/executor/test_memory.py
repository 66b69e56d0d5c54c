"""Sizing the KV pool from a profiling forward: the arithmetic, and the profile step on a CPU
with fake memory readings (the CUDA reader itself runs only on a GPU)."""

from __future__ import annotations

import pytest
import torch
from tiny_llama import tiny_model
from transformers import LlamaConfig

from iterserve.config import ConfigError, EngineConfig
from iterserve.executor.attention import KVCache
from iterserve.executor.kv_sizing import num_kv_blocks_for
from iterserve.executor.memory import (
    MemoryProfile,
    kv_cache_budget,
    profile_memory,
    worst_case_batch,
)
from iterserve.kernels.platform import TorchPlatform

GIB = 1 << 30


def test_budget_subtracts_peak_without_dummy_pool_non_torch_and_graph_reserve() -> None:
    profile = MemoryProfile(total=80 * GIB, peak_torch=20 * GIB, non_torch=GIB)
    # 0.9 * 80 = 72; peak 20 less the dummy pool's 2 = 18; minus 1 non-torch, minus 0.5 graphs.
    assert kv_cache_budget(profile, 0.9, 2 * GIB, GIB // 2) == int(72 * GIB) - 18 * GIB - GIB - (
        GIB // 2
    )
    assert kv_cache_budget(profile, 0.5, 0) == 40 * GIB - 20 * GIB - GIB


def test_nothing_left_for_the_kv_cache_is_a_config_error() -> None:
    profile = MemoryProfile(total=16 * GIB, peak_torch=14 * GIB, non_torch=GIB)
    with pytest.raises(ConfigError, match="no GPU memory is left for the KV cache"):
        kv_cache_budget(profile, 0.9, 0)


def test_worst_case_batch_spreads_the_token_budget_over_the_sequences() -> None:
    scheduled, num_blocks = worst_case_batch(100, 8, 64, 16)
    assert [s.num_scheduled_tokens for s in scheduled] == [13] * 4 + [12] * 4
    assert all(s.sample and s.num_computed_tokens == 0 for s in scheduled)
    tables = [b for s in scheduled for b in s.block_table]
    assert sorted(tables) == list(range(num_blocks)) == list(range(8))
    # Fewer tokens than sequences: one token each; lengths capped at max_model_len.
    assert len(worst_case_batch(3, 8, 64, 16)[0]) == 3
    assert {s.num_scheduled_tokens for s in worst_case_batch(512, 2, 100, 16)[0]} == {100}


class FakeReader:
    """Readings as a GPU would give them; records that the peak was reset before the forward."""

    def __init__(self, profile: MemoryProfile) -> None:
        self.profile = profile
        self.events: list[str] = []

    def reset_peak(self) -> None:
        self.events.append("reset")

    def read(self) -> MemoryProfile:
        self.events.append("read")
        return self.profile


def test_profile_step_runs_the_worst_case_forward_and_sizes_the_pool() -> None:
    model = tiny_model(TorchPlatform())
    readings = MemoryProfile(total=10 * GIB, peak_torch=3 * GIB, non_torch=GIB // 2)
    reader = FakeReader(readings)
    # 2 requests of 50 tokens (ids past the vocabulary of 50 are wrapped): 4 blocks each.
    got, dummy_bytes = profile_memory(model, 100, 2, 64, 16, reader)
    assert got == readings and reader.events == ["reset", "read"]
    per_block = KVCache.bytes_per_block(len(model.layers), 16, 2, 8, torch.float32)
    assert dummy_bytes == 8 * per_block

    hf = LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2
    )
    config = EngineConfig.from_kwargs(gpu_memory_utilization=0.5)
    per_block = KVCache.bytes_per_block(2, 16, 2, 8, torch.float32)
    blocks = num_kv_blocks_for(
        config,
        hf,
        torch.float32,
        torch.device("cpu"),
        lambda: (readings, GIB),
        graph_reserve=GIB // 4,
    )
    assert blocks == (5 * GIB - 2 * GIB - GIB // 2 - GIB // 4) // per_block
    with pytest.raises(ConfigError, match="no GPU memory"):
        num_kv_blocks_for(
            EngineConfig.from_kwargs(gpu_memory_utilization=0.2),
            hf,
            torch.float32,
            torch.device("cpu"),
            lambda: (readings, 0),
        )
