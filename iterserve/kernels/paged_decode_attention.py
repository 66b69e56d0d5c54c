"""Paged decode attention: one query token per sequence over its context in the paged KV cache.

Reads keys and values in place from their blocks (vLLM's PagedAttention: Kwon et al., 2023,
"Efficient Memory Management for Large Language Model Serving with PagedAttention",
arXiv:2309.06180) instead of gathering them into a contiguous copy first. The CPU kernel is C
(``csrc/paged_decode_attention.c``, built by :mod:`iterserve.kernels.cpu_build`);
:func:`paged_decode_attention_reference` is the plain torch definition tests compare it to.
"""

from __future__ import annotations

import ctypes

import torch

from iterserve.kernels.cpu_build import load_cpu_kernels
from iterserve.kernels.kv_quant import SCALE_BYTES, dequantize_kv_rows

MAX_QUERY_HEADS_PER_KV_HEAD = 64  # the C kernel's per-group scratch size


def paged_decode_attention_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of each sequence's one query token over its first ``seq_lens[i]`` cached tokens.

    Args:
        q: [num_seqs, num_heads, head_dim].
        key_cache, value_cache: [num_kv_heads, num_blocks, block_size, head_dim], q's dtype,
            or int8 rows with their scales (``head_dim + 4`` bytes,
            :mod:`~iterserve.kernels.kv_quant`).
        block_tables: [num_seqs, max_num_blocks] int64; token ``t`` of sequence ``i`` sits at
            offset ``t % block_size`` of block ``block_tables[i, t // block_size]``.
        seq_lens: [num_seqs] int64, >= 1.
        scale: multiplies q . k (usually head_dim ** -0.5).

    Returns:
        [num_seqs, num_heads, head_dim] in q's dtype; softmax in float32.
    """
    num_kv_heads, _, block_size, width = key_cache.shape
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    for i, n in enumerate(seq_lens.tolist()):
        blocks = block_tables[i, : -(-n // block_size)]
        k = key_cache[:, blocks].reshape(num_kv_heads, -1, width)[:, :n]
        v = value_cache[:, blocks].reshape(num_kv_heads, -1, width)[:, :n]
        if key_cache.dtype == torch.int8:
            k, v = dequantize_kv_rows(k, torch.float32), dequantize_kv_rows(v, torch.float32)
        k, v = k.float(), v.float()
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [H, n, D]
        scores = torch.einsum("hd,hnd->hn", q[i].float(), k) * scale
        out[i] = torch.einsum("hn,hnd->hd", scores.softmax(-1), v).to(q.dtype)
    return out


_KERNELS = {
    torch.float32: "paged_decode_attention_f32",
    torch.bfloat16: "paged_decode_attention_bf16",
    torch.int8: "paged_decode_attention_int8",  # int8 caches; q float32 or bfloat16
}
_P, _I = ctypes.c_void_p, ctypes.c_int64
# out, q, q_seq_stride, key_cache, value_cache, block_tables, block_table_stride, seq_lens,
# num_seqs, num_heads, num_kv_heads, head_dim, num_blocks, block_size, scale, num_threads
_ARGTYPES: list[type] = [_P, _P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I]
_ARGTYPES += [ctypes.c_float, ctypes.c_int]
_INT8_ARGTYPES = [*_ARGTYPES, ctypes.c_int]  # then whether q and out are bfloat16


def cpu_kernel_available(dtype: torch.dtype) -> bool:
    """Whether :func:`paged_decode_attention_cpu` runs for ``dtype`` here (builds on first call)."""
    return dtype in _KERNELS and load_cpu_kernels() is not None


def _kernel(dtype: torch.dtype) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    lib = load_cpu_kernels()
    if lib is None:
        raise RuntimeError("the CPU kernels could not be built on this machine (no C compiler?)")
    fn = getattr(lib, _KERNELS[dtype])
    if fn.argtypes is None:
        fn.argtypes = _INT8_ARGTYPES if dtype == torch.int8 else _ARGTYPES
        fn.restype = ctypes.c_int
    return fn


def paged_decode_attention_cpu(
    out: torch.Tensor,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """:func:`paged_decode_attention_reference` by the C kernel, written into ``out``.

    Args:
        out: [num_seqs, num_heads, head_dim], contiguous, q's dtype.
        q: [num_seqs, num_heads, head_dim] float32 or bfloat16; heads and dims contiguous
            (rows may be strided: a view into the fused qkv projection is fine).
        key_cache, value_cache: [num_kv_heads, num_blocks, block_size, head_dim], contiguous,
            q's dtype; or int8 rows of ``head_dim + 4`` bytes with their scales
            (:mod:`~iterserve.kernels.kv_quant`).
        block_tables: [num_seqs, max_num_blocks] int64, last dim contiguous. Every block id
            a sequence uses must be < num_blocks and ``seq_lens[i] <= max_num_blocks *
            block_size``: the kernel reads memory where the table points, unchecked (callers
            check once per iteration, see :func:`check_block_tables`).
        seq_lens: [num_seqs] int64, contiguous, each >= 1.

    Returns:
        ``out``.

    Raises:
        ValueError: on a dtype, device, shape or layout the kernel does not take.
        RuntimeError: when the kernel is unavailable or its scratch allocation failed.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, width = key_cache.shape
    cache_dtype = key_cache.dtype
    quantized = cache_dtype == torch.int8
    if q.device.type != "cpu" or not (q.dtype == out.dtype and cache_dtype == value_cache.dtype):
        raise ValueError("q, out and the caches must be CPU tensors, q and out of one dtype")
    if q.dtype not in (torch.float32, torch.bfloat16) or cache_dtype not in (q.dtype, torch.int8):
        raise ValueError(
            f"the kernel takes float32 or bfloat16 q and caches of q's dtype or int8, got "
            f"{q.dtype} and {cache_dtype}"
        )
    if key_cache.shape != value_cache.shape or width != head_dim + quantized * SCALE_BYTES:
        raise ValueError(f"cache shapes {key_cache.shape}, {value_cache.shape} vs q {q.shape}")
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_QUERY_HEADS_PER_KV_HEAD:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads")
    if q.stride(2) != 1 or q.stride(1) != head_dim or not out.is_contiguous():
        raise ValueError("q needs contiguous heads and dims; out must be contiguous")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("the KV caches must be contiguous")
    if out.shape != q.shape or block_tables.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
        raise ValueError("out, block_tables and seq_lens must have one row per sequence")
    if block_tables.dtype != torch.int64 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be int64 with a contiguous last dim")
    if seq_lens.dtype != torch.int64 or not seq_lens.is_contiguous():
        raise ValueError("seq_lens must be contiguous int64")
    if num_seqs == 0:
        return out
    args = [
        out.data_ptr(), q.data_ptr(), q.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), num_seqs,
        num_heads, num_kv_heads, head_dim, num_blocks, block_size, scale, torch.get_num_threads(),
    ]  # fmt: skip
    if quantized:
        args.append(int(q.dtype == torch.bfloat16))
    status = _kernel(cache_dtype)(*args)
    if status != 0:
        raise RuntimeError("paged decode attention: scratch allocation failed")
    return out


def check_block_tables(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int
) -> None:
    """Check that every block a sequence reads exists (what the kernel cannot check).

    Raises:
        ValueError: on a block id outside ``[0, num_blocks)`` within a sequence's length,
            a length beyond its table, or a length < 1.
    """
    if seq_lens.numel() == 0:
        return
    width = block_tables.shape[1]
    if int(seq_lens.min()) < 1 or int(seq_lens.max()) > width * block_size:
        raise ValueError(f"seq_lens must be in [1, {width * block_size}]")
    used = torch.arange(width, device=seq_lens.device) < (-(-seq_lens // block_size))[:, None]
    ids = block_tables[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"block ids must be in [0, {num_blocks})")
