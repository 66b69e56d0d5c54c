"""The Triton KV-cache write against its torch reference (exact: it copies), under Triton's
interpreter without a GPU (tests/conftest.py sets ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import pytest
import torch

from iterserve.kernels.triton_write_kv import write_kv, write_kv_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_kv_heads, head_dim, num_blocks, block_size = 7, 3, 64, 5, 16
    # value a strided view into a fused qkv output, as the model passes it
    qkv = torch.randn(num_tokens, 2 + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = qkv[:, 2 : 2 + num_kv_heads], qkv[:, 2 + num_kv_heads :]
    key = key.contiguous()  # rotated keys are a new tensor, values stay views
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    key_cache, value_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    write_kv(key, value, key_cache, value_cache, slot_mapping)
    write_kv_reference(key, value, expected_k, expected_v, slot_mapping)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
    assert key_cache.count_nonzero() == num_tokens * num_kv_heads * head_dim


def test_rejects_bad_inputs() -> None:
    key = torch.zeros(2, 1, 64)
    cache = torch.zeros(1, 2, 16, 64)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="one dtype"):
        write_kv(key, key, cache.half(), cache.half(), slots)
    with pytest.raises(ValueError, match="does not fit"):
        write_kv(torch.zeros(2, 2, 64), torch.zeros(2, 2, 64), cache, cache, slots)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        write_kv(key, key, cache, cache, slots.int())
