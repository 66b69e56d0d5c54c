"""KV sizing: how many KV blocks the pool holds (flag, byte budget, or memory profile)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from iterserve.config import ConfigError, EngineConfig, GiB
from iterserve.executor.attention import KVCache
from iterserve.executor.memory import MemoryProfile, kv_cache_budget

logger = logging.getLogger(__name__)


def num_kv_blocks_for(
    config: EngineConfig,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    profile: Callable[[], tuple[MemoryProfile, int]] | None = None,
    graph_reserve: int = 0,
    num_kv_heads: int | None = None,
) -> int:
    """KV blocks in the pool: ``--num-kv-blocks``, else ``--kv-cache-memory`` bytes, else (on a
    GPU) what :func:`~iterserve.executor.memory.kv_cache_budget` leaves after ``profile``
    (the profiling forward: readings and the dummy pool's bytes) and ``graph_reserve`` bytes,
    else 1 GiB (CPU). ``num_kv_heads``: the KV heads this rank holds (default: the model's).

    Raises:
        ConfigError: the budget holds no block.
    """
    cache = config.cache
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    head_dim = (
        getattr(hf_config, "head_dim", None)
        or hf_config.hidden_size // hf_config.num_attention_heads
    )
    per_block = KVCache.bytes_per_block(
        hf_config.num_hidden_layers,
        cache.block_size,
        num_kv_heads or hf_config.num_key_value_heads,
        head_dim,
        dtype,
    )
    if cache.kv_cache_memory is not None:
        budget = cache.kv_cache_memory
    elif profile is not None:
        readings, dummy_kv_bytes = profile()
        budget = kv_cache_budget(
            readings, cache.gpu_memory_utilization, dummy_kv_bytes, graph_reserve
        )
        logger.info(
            "memory profile: %s, dummy KV %d bytes, graph reserve %d bytes -> KV budget %d bytes",
            readings,
            dummy_kv_bytes,
            graph_reserve,
            budget,
        )
    else:
        budget = GiB
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ConfigError(f"KV cache budget of {budget} bytes holds no block of {per_block} bytes")
    return int(num_blocks)
