"""Writing new keys and values into the paged KV cache through the slot mapping, in Triton.

The contract of :meth:`~iterserve.kernels.platform.Platform.write_kv` (vLLM's
``reshape_and_cache``): token ``t``'s key and value go to offset ``slot % block_size`` of block
``slot // block_size``, ``slot = slot_mapping[t]``, of the head-major caches
``[num_kv_heads, num_blocks, block_size, head_dim]``. One program per (token, KV head) copies
one ``head_dim`` row of each. A negative slot (a padding row of a CUDA-graph decode batch) is
skipped: the pool has no reserved block to write padding into. :func:`write_kv_reference` is
the plain-torch definition.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, HEAD_DIM]
    value_ptr,
    key_cache_ptr,  # [num_kv_heads, num_blocks, BLOCK_SIZE, HEAD_DIM]
    value_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_c_h,
    HEAD_DIM: tl.constexpr,
):
    token_idx = tl.program_id(0)
    head_idx = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    slot = tl.load(slot_mapping_ptr + token_idx)
    if slot < 0:  # a padding row
        return
    # A contiguous head slice of the cache is [num_blocks * BLOCK_SIZE, HEAD_DIM]: slot is its row.
    dst = head_idx.to(tl.int64) * stride_c_h + slot * HEAD_DIM + offs_d
    token = token_idx.to(tl.int64)
    key = tl.load(key_ptr + token * stride_k_t + head_idx * stride_k_h + offs_d)
    value = tl.load(value_ptr + token * stride_v_t + head_idx * stride_v_h + offs_d)
    tl.store(key_cache_ptr + dst, key)
    tl.store(value_cache_ptr + dst, value)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's key and value into its cache slot, in place.

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim], heads and dims contiguous (token
            rows may be strided views into the fused qkv output, each its own strides); head_dim
            a power of two.
        key_cache, value_cache: [num_kv_heads, num_blocks, block_size, head_dim] contiguous,
            key's dtype.
        slot_mapping: [num_tokens] int64, ``block_id * block_size + offset``, each in
            ``[0, num_blocks * block_size)``, or negative for a row to skip (padding): not
            checked here (that would sync the device every layer); the scheduler's block
            manager hands out only slots of the pool.

    Raises:
        ValueError: on shapes, dtypes, devices or layouts the kernel does not take.
    """
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"key and value must be [num_tokens, num_kv_heads, head_dim], got "
            f"{tuple(key.shape)}, {tuple(value.shape)}"
        )
    num_tokens, num_kv_heads, head_dim = key.shape
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"caches must match, got {tuple(key_cache.shape)}, {value_cache.shape}")
    if (key_cache.shape[0], key_cache.shape[3]) != (num_kv_heads, head_dim):
        raise ValueError(f"key {tuple(key.shape)} does not fit cache {tuple(key_cache.shape)}")
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    if {value.dtype, key_cache.dtype, value_cache.dtype} != {key.dtype}:
        raise ValueError("key, value and both caches must have one dtype")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")
    if key.stride()[1:] != (head_dim, 1) or value.stride()[1:] != (head_dim, 1):
        raise ValueError("key and value need contiguous heads and dims")
    if slot_mapping.dtype != torch.int64 or tuple(slot_mapping.shape) != (num_tokens,):
        raise ValueError(f"slot_mapping must be int64 [{num_tokens}], got {slot_mapping.shape}")
    if len({t.device for t in (key, value, key_cache, value_cache, slot_mapping)}) != 1:
        raise ValueError("all tensors must be on one device")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        HEAD_DIM=head_dim,
    )


def write_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """:func:`write_kv` in plain torch (same arguments; negative slots skipped)."""
    keep = slot_mapping >= 0
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    slots = slot_mapping[keep]
    key_cache.view(num_kv_heads, -1, head_dim)[:, slots] = key[keep].transpose(0, 1)
    value_cache.view(num_kv_heads, -1, head_dim)[:, slots] = value[keep].transpose(0, 1)
