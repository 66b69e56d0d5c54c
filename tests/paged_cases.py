"""Random paged-decode cases shared by the decode kernel tests (bfloat16/float32 caches and
int8 ones)."""

from __future__ import annotations

import torch

from iterserve.kernels.kv_quant import quantize_kv_rows


def random_decode_case(
    gen: torch.Generator,
    dtype: torch.dtype,
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    cache_dtype: torch.dtype | None = None,
    spread: float = 1.0,
) -> tuple[torch.Tensor, ...]:
    """(q, key_cache, value_cache, block_tables, seq_lens): caches [num_kv_heads, num_blocks,
    block_size, head_dim] in ``cache_dtype`` (default q's; int8: rows quantized with their
    scales, ``head_dim + 4``), blocks scattered over the pool, each
    sequence's distinct (as the block manager gives), tables wider than needed; q [num_seqs,
    num_heads, head_dim] in ``dtype``, a strided view into a fused qkv output, as the model
    passes it. ``spread``: the keys' rows range over [1 / spread, spread] times their scale
    along each block (tokens of very different magnitudes, as real keys have)."""
    width = max(-(-n // block_size) for n in seq_lens) + 1
    num_blocks = len(seq_lens) * width + 3
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    rows = torch.logspace(-1, 1, block_size, base=spread)[None, None, :, None]
    key_cache = torch.randn(shape, generator=gen) * rows
    value_cache = torch.randn(shape, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * width]
    block_tables = perm.view(len(seq_lens), width).contiguous()
    qkv = torch.randn(len(seq_lens), (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q = qkv.to(dtype)[:, : num_heads * head_dim].view(len(seq_lens), num_heads, head_dim)
    if cache_dtype == torch.int8:
        key_cache, value_cache = quantize_kv_rows(key_cache), quantize_kv_rows(value_cache)
    else:
        key_cache, value_cache = (
            key_cache.to(cache_dtype or dtype),
            value_cache.to(cache_dtype or dtype),
        )
    return q, key_cache, value_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int64)
