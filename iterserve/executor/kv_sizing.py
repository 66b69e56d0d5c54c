"""KV sizing: how many KV blocks the pool holds (flag, byte budget, or memory profile), and
a rank's KV cache allocated at that size with its host swap pool."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from iterserve.config import ConfigError, EngineConfig, GiB
from iterserve.engine.factory import num_host_blocks
from iterserve.executor.attention import KVCache
from iterserve.executor.memory import (
    CUDA_GRAPH_RESERVE,
    CudaMemoryReader,
    MemoryProfile,
    kv_cache_budget,
    profile_memory,
)
from iterserve.kernels.kv_quant import cache_dtype
from iterserve.models.llama import LlamaForCausalLM
from iterserve.models.parallel import TPGroup

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
        cache_dtype(cache.kv_cache_dtype, dtype),
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


def build_kv_cache(
    config: EngineConfig,
    hf_config: Any,
    model: LlamaForCausalLM,
    dtype: torch.dtype,
    device: torch.device,
    graphs: bool,
    tp: TPGroup,
) -> KVCache:
    """Size and allocate rank ``tp.rank``'s KV cache (``dtype``, the model's, or int8 by
    ``--kv-cache-dtype``) on ``device`` for ``model``
    (its shard's KV heads) and its host swap pool of ``swap_space`` GiB. Both pools are the
    minimum over the ranks (a collective every rank joins), so block ids mean the same on
    every rank.

    Args:
        graphs: decode CUDA graphs will be captured (their memory is reserved).

    Raises:
        ConfigError: the budget holds no block, or the pool cannot be allocated.
    """
    assert config.model.max_model_len is not None, "resolve max_model_len first"
    profile: Callable[[], tuple[MemoryProfile, int]] | None = None
    if device.type == "cuda":
        profile = functools.partial(
            profile_memory,
            model,
            config.scheduler.max_num_batched_tokens,
            config.scheduler.max_num_seqs,
            config.model.max_model_len,
            config.cache.block_size,
            CudaMemoryReader(device),
        )
    reserve = CUDA_GRAPH_RESERVE if graphs else 0
    num_blocks = num_kv_blocks_for(
        config, hf_config, dtype, device, profile, reserve, model.num_kv_heads
    )
    num_blocks = tp.all_reduce_min(num_blocks)
    num_layers, block_size = len(model.layers), config.cache.block_size
    kv_dtype = cache_dtype(config.cache.kv_cache_dtype, dtype)
    per_block = KVCache.bytes_per_block(
        num_layers, block_size, model.num_kv_heads, model.head_dim, kv_dtype
    )
    num_host = tp.all_reduce_min(num_host_blocks(config.cache, per_block))
    try:
        return KVCache(
            num_layers,
            num_blocks,
            block_size,
            model.num_kv_heads,
            model.head_dim,
            kv_dtype,
            device,
            num_host,
        )
    except OSError as e:  # the CPU pool's mmap: ENOMEM
        raise ConfigError(
            f"the KV pool of {num_blocks} blocks ({num_blocks * per_block} bytes) cannot be "
            f"allocated ({e.strerror or e}): lower --kv-cache-memory or --num-kv-blocks"
        ) from e
