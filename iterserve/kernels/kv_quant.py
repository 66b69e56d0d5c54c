"""The int8 KV-cache row format (``--kv-cache-dtype int8``) and its torch definitions.

Each cached row (one token's key or value for one KV head, ``head_dim`` values) is stored as
``head_dim`` int8 values followed by the row's float32 scale, ``head_dim + 4`` bytes in all:
symmetric per-token, per-head quantization (the scheme of LMDeploy's and TensorRT-LLM's int8
KV caches, here without a zero point): ``scale = max |x| / 127``, ``q = round(x * (127 /
max |x|))`` (half to even), ``x ~ q * scale``. The scale living in the row keeps a cache
layer one tensor ``[num_kv_heads, num_blocks, block_size, head_dim + 4]``: swapping, prefix
caching and block copies move the scales with the values and need no change.

The C kernels (``reshape_and_cache_int8`` in ``csrc/layer_ops.c``,
``paged_decode_attention_int8`` in ``csrc/paged_decode_attention.c``) compute what
:func:`quantize_kv_rows` and :func:`dequantize_kv_rows` define.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # the float32 scale after each row's int8 values


def cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: ``dtype`` (the model's) for ``auto``, int8 for ``int8``."""
    return torch.int8 if kv_cache_dtype == "int8" else dtype


def row_width(head_dim: int, cache_dtype: torch.dtype) -> int:
    """The last dimension of a cache of ``cache_dtype`` for rows of ``head_dim`` values: the
    values, plus :data:`SCALE_BYTES` for int8."""
    return head_dim + SCALE_BYTES if cache_dtype == torch.int8 else head_dim


def quantize_kv_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows of float values as int8 rows with their scales.

    Args:
        x: [..., head_dim] float32 or bfloat16.

    Returns:
        [..., head_dim + 4] int8: the quantized values, then the float32 scale's bytes.
    """
    xf = x.float()
    absmax = xf.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    # A true division (``127.0 / tensor`` would multiply by the reciprocal: another rounding).
    inverse = torch.where(absmax > 0, absmax.new_tensor(127.0) / absmax, torch.zeros_like(absmax))
    # A NaN in the row makes its scale NaN (it reads back NaN); a NaN product stores 0, one
    # past +-127 (the inverse of a denormal row's maximum overflows) stores +-127.
    q = (xf * inverse).nan_to_num(nan=0.0).clamp(-127, 127).round().to(torch.int8)
    return torch.cat((q, (absmax / 127.0).view(torch.int8)), dim=-1)


def dequantize_kv_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`quantize_kv_rows`'s rows back to values.

    Args:
        rows: [..., head_dim + 4] int8, last dim contiguous.
        dtype: of the result (the model's).

    Returns:
        [..., head_dim] ``dtype``: each value times its row's scale (in float32).
    """
    head_dim = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., head_dim:].clone().view(torch.float32)  # [..., 1]; own, aligned storage
    return (rows[..., :head_dim].float() * scale).to(dtype)
