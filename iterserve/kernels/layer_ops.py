"""Elementwise ops of a Llama decoder layer as single C passes for CPUs (``csrc/layer_ops.c``).

RMSNorm with the residual add, SiLU-and-multiply, rotary embedding, the KV-cache write, and
the greedy sampler's row argmax:
at decode batch sizes each torch op costs more in dispatch, temporaries and thread start-up
than in arithmetic, and a layer chains about fifteen of them. Each launcher checks dtypes,
shapes and layouts and documents them; each ``*_reference`` is the torch definition (what
Hugging Face's modules compute, intermediate roundings included) the tests compare to.
float32 and bfloat16 only: :func:`~iterserve.kernels.platform.select_platform` checks
:func:`layer_ops_available` once and runs plain torch where they are not.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from iterserve.kernels.cpu_build import load_cpu_kernels
from iterserve.kernels.kv_quant import SCALE_BYTES, row_width

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I, _F, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_ARGTYPES: dict[str, list[type]] = {
    # out, x, x_stride, residual, weight, num_tokens, hidden, eps, num_threads
    "rms_norm": [_P, _P, _I, _P, _P, _I, _I, _F, _N],
    # out, gate_up, num_tokens, inter, num_threads
    "silu_and_mul": [_P, _P, _I, _I, _N],
    # q, q_stride, k, k_stride, positions, cos, sin, num_tokens, heads, kv heads, dim,
    # max_position, threads
    "rotary_embedding": [_P, _I, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _N],
    # key, value, kv_stride, key_cache, value_cache, slot_mapping, num_tokens, num_kv_heads,
    # head_dim, num_slots, elem_size
    "reshape_and_cache": [_P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I],
    # the same, the last argument whether key and value are bfloat16 (else float32)
    "reshape_and_cache_int8": [_P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _N, _N],
    # out, rows, num_rows, head_dim, whether out is bfloat16 (else float32), num_threads
    "dequantize_kv_rows": [_P, _P, _I, _I, _N, _N],
    # out, x, num_rows, n, row_stride, num_threads
    "argmax_rows": [_P, _P, _I, _I, _I, _N],
}


def layer_ops_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the C layer ops run for this device and dtype (builds them on first call)."""
    return device.type == "cpu" and dtype in _SUFFIX and load_cpu_kernels() is not None


@functools.cache
def _fn(name: str, dtype: torch.dtype | None) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    lib = load_cpu_kernels()
    if lib is None:
        raise RuntimeError("the CPU kernels could not be built on this machine (no C compiler?)")
    if dtype is not None and dtype not in _SUFFIX:
        raise ValueError(f"the CPU layer ops take float32 or bfloat16, got {dtype}")
    fn = getattr(lib, name if dtype is None else f"{name}_{_SUFFIX[dtype]}")
    fn.argtypes = _ARGTYPES[name]
    returns_count = name in ("reshape_and_cache", "reshape_and_cache_int8", "rotary_embedding")
    fn.restype = ctypes.c_int64 if returns_count else None
    return fn


def _check_rows(name: str, x: torch.Tensor, dim: int) -> None:
    if x.device.type != "cpu" or x.dim() != dim or x.stride(-1) != 1:
        raise ValueError(f"{name} must be a {dim}-d CPU tensor with a contiguous last dim")


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Hugging Face's ``LlamaRMSNorm`` after an optional residual add (in x's dtype).

    Returns:
        ``(weight * normalised, residual + x)``, or ``(weight * normalised x, None)``.
    """
    if residual is not None:
        x = residual = x + residual
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), residual


def rms_norm_cpu(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`rms_norm_reference` in one pass; with ``residual``, it becomes ``x + residual``.

    Args:
        x: [num_tokens, hidden], float32 or bfloat16, last dim contiguous.
        weight: [hidden], x's dtype.
        eps: added to the mean square.
        residual: [num_tokens, hidden] contiguous, x's dtype, updated in place, or None.

    Returns:
        A new contiguous [num_tokens, hidden] tensor.

    Raises:
        ValueError: on a dtype, device, shape or layout the kernel does not take.
    """
    _check_rows("x", x, 2)
    num_tokens, hidden = x.shape
    if weight.shape != (hidden,) or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [{hidden}] in {x.dtype}")
    if residual is not None and (
        residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous()
    ):
        raise ValueError("residual must be contiguous with x's shape and dtype")
    out = torch.empty(num_tokens, hidden, dtype=x.dtype)
    _fn("rms_norm", x.dtype)(
        out.data_ptr(), x.data_ptr(), x.stride(0),
        residual.data_ptr() if residual is not None else None,
        weight.data_ptr(), num_tokens, hidden, eps, torch.get_num_threads(),
    )  # fmt: skip
    return out


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up``, gate_up [num_tokens, 2 * inter] -> [num_tokens, inter]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`silu_and_mul_reference` in one pass.

    Args:
        gate_up: [num_tokens, 2 * inter] contiguous, float32 or bfloat16 (gate columns first).

    Returns:
        [num_tokens, inter] in gate_up's dtype.

    Raises:
        ValueError: on a dtype, device, shape or layout the kernel does not take.
    """
    _check_rows("gate_up", gate_up, 2)
    if not gate_up.is_contiguous() or gate_up.shape[1] % 2:
        raise ValueError("gate_up must be contiguous with an even number of columns")
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype)
    _fn("silu_and_mul", gate_up.dtype)(
        out.data_ptr(), gate_up.data_ptr(), num_tokens, inter, torch.get_num_threads()
    )
    return out


def rotary_embedding_reference(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Rotary embedding, half-split layout (RoFormer, Su et al., 2021), as Hugging Face's
    ``apply_rotary_pos_emb``: x [num_tokens, num_heads, head_dim]; cos, sin [max_position,
    head_dim] (float32 or x's dtype), cast to x's dtype."""
    c = cos[positions].to(x.dtype).unsqueeze(1)
    s = sin[positions].to(x.dtype).unsqueeze(1)
    half = x.shape[-1] // 2
    return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s


def rotary_embedding_cpu(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """:func:`rotary_embedding_reference` applied to q and k in place.

    Args:
        q: [num_tokens, num_heads, head_dim], float32 or bfloat16; heads and dims contiguous
            (token rows may be strided, e.g. views into the fused qkv output).
        k: [num_tokens, num_kv_heads, head_dim], the same dtype and layout rules.
        positions: [num_tokens] int64, each in ``[0, max_position)``.
        cos, sin: [max_position, head_dim] contiguous, in q's dtype.

    Raises:
        ValueError: on a dtype, device, shape or layout the kernel does not take, or a
            position outside the cache (its token is left unrotated).
    """
    for name, x in (("q", q), ("k", k)):
        _check_rows(name, x, 3)
        if x.stride(1) != x.shape[2] or x.dtype != q.dtype or x.shape[0] != q.shape[0]:
            raise ValueError(f"{name} needs contiguous heads, q's dtype and one row per token")
    head_dim = q.shape[2]
    if k.shape[2] != head_dim or head_dim % 2:
        raise ValueError("q and k need the same even head_dim")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != q.dtype or not t.is_contiguous() or t.shape[1:] != (head_dim,):
            raise ValueError(f"{name} must be contiguous [max_position, {head_dim}] in q's dtype")
    if positions.dtype != torch.int64 or positions.shape != (q.shape[0],):
        raise ValueError("positions must be int64 [num_tokens]")
    positions = positions.contiguous()
    num_bad = _fn("rotary_embedding", q.dtype)(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), positions.data_ptr(),
        cos.data_ptr(), sin.data_ptr(), q.shape[0], q.shape[1], k.shape[1], head_dim,
        cos.shape[0], torch.get_num_threads(),
    )  # fmt: skip
    if num_bad:
        raise ValueError(f"{num_bad} positions outside [0, {cos.shape[0]})")


def reshape_and_cache_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's key and value into its slot (vLLM's ``reshape_and_cache``).

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim]; heads and dims contiguous, the
            same token stride (views into the fused qkv output are fine).
        key_cache, value_cache: [num_kv_heads, num_blocks, block_size, head_dim] contiguous,
            key's dtype; or int8 ``[..., head_dim + 4]``: each row quantized with its scale
            (:func:`~iterserve.kernels.kv_quant.quantize_kv_rows`).
        slot_mapping: [num_tokens] int64 contiguous, ``block_id * block_size + offset``, each
            in ``[0, num_blocks * block_size)``; negative slots are skipped, and so are slots
            past the cache (then ValueError, after the other tokens are written).

    Raises:
        ValueError: on a dtype, shape or layout the kernel does not take, or a slot outside
            the cache.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    num_slots = key_cache.shape[1] * key_cache.shape[2]
    quantized = key_cache.dtype == torch.int8
    if value.shape != key.shape or value.stride() != key.stride() or key.stride(1) != head_dim:
        raise ValueError("key and value need one shape, one stride and contiguous heads")
    if key.stride(2) != 1 or key.dtype != value.dtype:
        raise ValueError("key and value need a contiguous last dim and one dtype")
    if quantized and (key.dtype not in (torch.float32, torch.bfloat16) or head_dim > 512):
        raise ValueError("an int8 cache takes float32 or bfloat16 rows of at most 512 values")
    width = row_width(head_dim, key_cache.dtype)
    for cache in (key_cache, value_cache):
        if cache.shape != (num_kv_heads, key_cache.shape[1], key_cache.shape[2], width):
            raise ValueError(
                f"cache shape {tuple(cache.shape)} does not fit key {tuple(key.shape)}"
            )
        if not cache.is_contiguous() or cache.device.type != "cpu":
            raise ValueError("the caches must be contiguous CPU tensors")
        if cache.dtype not in (key.dtype, torch.int8) or cache.dtype != key_cache.dtype:
            raise ValueError("the caches must both be of key's dtype, or both int8")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
        raise ValueError("slot_mapping must be int64 [num_tokens]")
    slot_mapping = slot_mapping.contiguous()
    args = [
        key.data_ptr(), value.data_ptr(), key.stride(0), key_cache.data_ptr(),
        value_cache.data_ptr(), slot_mapping.data_ptr(), num_tokens, num_kv_heads, head_dim,
        num_slots,
    ]  # fmt: skip
    if quantized:
        is_bf16 = int(key.dtype == torch.bfloat16)
        num_bad = _fn("reshape_and_cache_int8", None)(*args, is_bf16, torch.get_num_threads())
    else:
        num_bad = _fn("reshape_and_cache", None)(*args, key.element_size())
    if num_bad:
        raise ValueError(f"{num_bad} slots outside the cache: slots must be < {num_slots}")


def dequantize_kv_rows_cpu(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`~iterserve.kernels.kv_quant.dequantize_kv_rows` in one parallel pass.

    Args:
        rows: [..., head_dim + 4] int8, contiguous (an int8 cache's rows with their scales).
        dtype: float32 or bfloat16, of the result.

    Returns:
        [..., head_dim] ``dtype``, contiguous.

    Raises:
        ValueError: on a dtype or layout the kernel does not take.
    """
    if rows.dtype != torch.int8 or not rows.is_contiguous() or rows.device.type != "cpu":
        raise ValueError("rows must be a contiguous int8 CPU tensor")
    if dtype not in _SUFFIX or rows.dim() == 0 or rows.shape[-1] <= SCALE_BYTES:
        raise ValueError(f"rows [..., head_dim + {SCALE_BYTES}] to float32 or bfloat16 only")
    head_dim = rows.shape[-1] - SCALE_BYTES
    out = torch.empty((*rows.shape[:-1], head_dim), dtype=dtype)
    _fn("dequantize_kv_rows", None)(
        out.data_ptr(), rows.data_ptr(), out.numel() // max(head_dim, 1), head_dim,
        int(dtype == torch.bfloat16), torch.get_num_threads(),
    )  # fmt: skip
    return out


def argmax_rows_cpu(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (first index on ties, first NaN wins) in one read of x.

    Args:
        x: [num_rows, n] float32 or bfloat16, n >= 1, last dim contiguous.

    Returns:
        [num_rows] int64.

    Raises:
        ValueError: on a dtype, device, shape or layout the kernel does not take.
    """
    _check_rows("x", x, 2)
    if x.shape[1] == 0:
        raise ValueError("argmax of empty rows")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _fn("argmax_rows", x.dtype)(
        out.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), torch.get_num_threads()
    )
    return out
