"""The platform: which implementation runs each hot op, chosen once at start.

:func:`select_platform` picks one :class:`Platform` for the serving device and dtype; the
executor passes that object to the model, the sampler and the attention, and nothing else
decides between plain torch and kernels. The ops are those of a Llama decoder iteration:
RMSNorm (with the fused residual add), SwiGLU's activation, rotary embedding, the KV-cache
write, paged decode attention, the greedy sampler's row argmax, and linear-weight packing.

- :class:`TorchPlatform`: plain torch on any device and dtype (the ``torch`` backend, and the
  fallback of ``auto``).
- :class:`CpuKernelsPlatform`: the C kernels of :mod:`~iterserve.kernels.layer_ops` and
  :mod:`~iterserve.kernels.paged_decode_attention` on CPUs, float32 or bfloat16, with the
  linear weights packed for oneDNN in bfloat16.
- :class:`TritonPlatform`: the Triton kernels of
  :mod:`~iterserve.kernels.triton_paged_attention` (one launch for a whole ragged batch of
  prefill chunks and decodes) and :mod:`~iterserve.kernels.triton_write_kv` on CUDA, or on a CPU
  under Triton's interpreter (``TRITON_INTERPRET=1``, for tests); the other ops plain torch.

Another accelerator is one more subclass of :class:`Platform` and one more branch in
:func:`select_platform`. Ops that need per-iteration preparation (rotary tables, decode
plans) return a callable bound to it, applied once per layer.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from iterserve import envs
from iterserve.kernels.grouped_decode_attention import (
    grouped_decode_attention,
    plan_decode_groups,
)
from iterserve.kernels.kv_quant import dequantize_kv_rows, quantize_kv_rows
from iterserve.kernels.layer_ops import (
    argmax_rows_cpu,
    dequantize_kv_rows_cpu,
    layer_ops_available,
    reshape_and_cache_cpu,
    rms_norm_cpu,
    rotary_embedding_cpu,
    silu_and_mul_cpu,
    silu_and_mul_reference,
)
from iterserve.kernels.packed_linear import PackedLinear, weight_packing_available
from iterserve.kernels.paged_decode_attention import (
    check_block_tables,
    cpu_kernel_available,
    paged_decode_attention_cpu,
)

# (q, k) -> (q, k) rotated; may rotate in place and return its arguments.
Rotate = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# (q, key_cache, value_cache) -> attention output [num_decodes, num_heads, head_dim].
DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (q, key_cache, value_cache) -> attention output [num_tokens, num_heads, head_dim].
RaggedAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (x, bias) -> x W^T (+ bias), W held in the platform's own layout.
LinearOp = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


class Platform(ABC):
    """The ops the model, the attention and the sampler run, for one device and dtype.

    Every op takes tensors on the platform's device in the serving dtype (int64 for indices)
    and raises ``ValueError`` on shapes, dtypes or layouts it does not take.
    """

    name: ClassVar[str]  # the ``--attention-backend`` value that selects it
    # Whether write_kv and decode_attention take int8 caches (--kv-cache-dtype int8).
    int8_kv_cache: ClassVar[bool] = True

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Root-mean-square norm accumulated in float32.

        Args:
            x: [num_tokens, hidden], last dim contiguous.
            weight: [hidden], x's dtype.
            eps: added to the mean square.

        Returns:
            A new [num_tokens, hidden] tensor in x's dtype.
        """

    @abstractmethod
    def rms_norm_residual(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual), x + residual)``; ``residual`` ([num_tokens, hidden]
        contiguous, x's dtype) may be updated in place and returned."""

    @abstractmethod
    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's ``silu(gate) * up``: gate_up [num_tokens, 2 * inter] contiguous (gate
        columns first) -> [num_tokens, inter] in its dtype."""

    @abstractmethod
    def rotary(self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Rotate:
        """Rotary embedding (half-split layout) at ``positions``, prepared once per forward.

        Args:
            positions: [num_tokens] int64, each in ``[0, max_position)``.
            cos, sin: [max_position, head_dim] contiguous, in the model's dtype.

        Returns:
            The function rotating one layer's q [num_tokens, num_heads, head_dim] and k
            [num_tokens, num_kv_heads, head_dim] (heads and dims contiguous, token rows may
            be strided views into the fused qkv output), possibly in place.
        """

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write each token's key and value into its slot (vLLM's ``reshape_and_cache``).

        Args:
            key, value: [num_tokens, num_kv_heads, head_dim], heads and dims contiguous.
            key_cache, value_cache: [num_kv_heads, num_blocks, block_size, head_dim]
                contiguous, key's dtype; or int8 rows with their scales (``head_dim + 4``,
                :mod:`~iterserve.kernels.kv_quant`) on a platform with
                :attr:`int8_kv_cache`.
            slot_mapping: [num_tokens] int64, ``block_id * block_size + offset``, each in
                ``[0, num_blocks * block_size)``; negative (a padding row, skipped) only on a
                platform with :meth:`static_decode_attention`.
        """

    @abstractmethod
    def decode_attention(
        self,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_list: list[int],
        num_blocks: int,
        block_size: int,
        scale: float,
    ) -> DecodeAttention:
        """Paged attention of one query token per sequence, prepared once per iteration.

        Args:
            block_tables: [num_decodes, max_num_blocks] int64; token ``t`` of decode ``i``
                sits at offset ``t % block_size`` of block ``block_tables[i, t // block_size]``.
            seq_lens: [num_decodes] int64, context length with the new token, each >= 1.
            seq_lens_list: the same lengths as Python ints.
            num_blocks, block_size: the KV cache's pool.
            scale: multiplies q . k (usually head_dim ** -0.5).

        Returns:
            The function of one layer's q [num_decodes, num_heads, head_dim], key_cache and
            value_cache ([num_kv_heads, num_blocks, block_size, head_dim], q's dtype, or
            int8 rows as :meth:`write_kv` writes them) giving
            [num_decodes, num_heads, head_dim] in q's dtype (softmax in float32).

        Raises:
            ValueError: a table points outside the pool (where the op cannot check it later).
        """

    def dequantize_kv(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """An int8 cache's rows back to values (what a prefill chunk over cached context
        reads): rows [..., head_dim + 4] int8 contiguous -> [..., head_dim] ``dtype``
        (:func:`~iterserve.kernels.kv_quant.dequantize_kv_rows`)."""
        return dequantize_kv_rows(rows, dtype)

    @abstractmethod
    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits.argmax(dim=-1)`` (first index on ties, first NaN wins): logits [num_rows,
        vocab] with a contiguous last dim -> [num_rows] int64."""

    def ragged_attention(
        self,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        query_lens: list[int],
        seq_lens_list: list[int],
        num_blocks: int,
        block_size: int,
        scale: float,
    ) -> RaggedAttention | None:
        """Causal paged attention of a whole iteration (prefill chunks and decodes) in one op,
        prepared once per iteration; None (the default) where the platform runs decodes by
        :meth:`decode_attention` and leaves prefill chunks to the caller.

        Args:
            block_tables: [num_reqs, max_num_blocks] int64, as for :meth:`decode_attention`.
            seq_lens: [num_reqs] int64, context length with this iteration's tokens.
            query_start_loc: [num_reqs + 1] int64 (cu_seqlens_q).
            query_lens, seq_lens_list: query and context lengths (tokens) as Python ints.
            num_blocks, block_size, scale: as for :meth:`decode_attention`.

        Returns:
            The function of one layer's q [num_tokens, num_heads, head_dim], key_cache and
            value_cache giving [num_tokens, num_heads, head_dim] in q's dtype.

        Raises:
            ValueError: a table points outside the pool.
        """
        return None

    def static_decode_attention(
        self,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        max_seq_len: int,
        scale: float,
    ) -> RaggedAttention | None:
        """Paged attention of one query token per row that CUDA graphs can capture: its launch
        depends only on tensor shapes and ``max_seq_len`` (a static bound, ``max_model_len``),
        never on the rows' current lengths, and it reads no value on the host (no table
        check: the caller checks the tables on the host). None (the default) where the
        platform has no such op: then decode iterations are not captured.

        Args:
            block_tables: [num_rows, max_num_blocks] int64, wide enough for ``max_seq_len``.
            seq_lens: [num_rows] int64, each in ``[1, max_seq_len]``; a padding row has 1
                (and a table of valid block ids, its output is discarded).
            query_start_loc: [num_rows + 1] int64, ``arange(num_rows + 1)``.
            max_seq_len: the static bound on ``seq_lens`` (tokens).
            scale: as for :meth:`decode_attention`.

        Returns:
            As for :meth:`ragged_attention`, with one query token per row.
        """
        return None

    def pack_linear_weight(self, weight: torch.Tensor) -> LinearOp | None:
        """The linear op on ``weight`` ([out_features, in_features], loaded, in the serving
        dtype) in this platform's own layout, or None where plain weights and ``F.linear``
        are what it runs (the default)."""
        return None


@dataclass(frozen=True)
class TorchPlatform(Platform):
    """Plain torch ops: any device, any dtype; the baseline the kernels are tested against."""

    name: ClassVar[str] = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # torch's fused kernel accumulates in float32 like Hugging Face's three-step version
        # (bit-identical in float32) without materialising float32 copies of x.
        return F.rms_norm(x, weight.shape, weight, eps)

    def rms_norm_residual(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_reference(gate_up)

    def rotary(self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Rotate:
        c = cos[positions].unsqueeze(1)  # [num_tokens, 1, head_dim]
        s = sin[positions].unsqueeze(1)
        return lambda q, k: (_apply_rotary(q, c, s), _apply_rotary(k, c, s))

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        num_kv_heads, width = key_cache.shape[0], key_cache.shape[3]
        if key_cache.dtype == torch.int8:  # rows with their scales (kernels/kv_quant.py)
            key, value = quantize_kv_rows(key), quantize_kv_rows(value)
        key_cache.view(num_kv_heads, -1, width)[:, slot_mapping] = key.transpose(0, 1)
        value_cache.view(num_kv_heads, -1, width)[:, slot_mapping] = value.transpose(0, 1)

    def decode_attention(
        self,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_list: list[int],
        num_blocks: int,
        block_size: int,
        scale: float,
    ) -> DecodeAttention:
        groups = plan_decode_groups(block_tables, seq_lens, seq_lens_list, block_size)
        return lambda q, kc, vc: grouped_decode_attention(q, groups, kc, vc, scale)

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [num_tokens, num_heads, head_dim]; cos, sin [num_tokens, 1, head_dim]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@dataclass(frozen=True)
class CpuKernelsPlatform(Platform):
    """The C kernels on a CPU (float32 or bfloat16), which round like the torch references;
    linear weights packed for oneDNN where ``pack_weights`` (bfloat16 with oneDNN)."""

    name: ClassVar[str] = "cpu"
    pack_weights: bool

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_cpu(x, weight, eps)

    def rms_norm_residual(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm_cpu(x, weight, eps, residual), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_cpu(gate_up)

    def rotary(self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Rotate:
        def rotate_in_place(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            rotary_embedding_cpu(q, k, positions, cos, sin)
            return q, k

        return rotate_in_place

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        reshape_and_cache_cpu(key, value, key_cache, value_cache, slot_mapping)

    def decode_attention(
        self,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_list: list[int],
        num_blocks: int,
        block_size: int,
        scale: float,
    ) -> DecodeAttention:
        # The kernel follows the tables unchecked: check them once per iteration, not per layer.
        check_block_tables(block_tables, seq_lens, num_blocks, block_size)

        def attend(
            q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
        ) -> torch.Tensor:
            out = torch.empty(q.shape, dtype=q.dtype)  # [num_decodes, num_heads, head_dim]
            return paged_decode_attention_cpu(
                out, q, key_cache, value_cache, block_tables, seq_lens, scale
            )

        return attend

    def dequantize_kv(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_kv_rows_cpu(rows, dtype)

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        return argmax_rows_cpu(logits)

    def pack_linear_weight(self, weight: torch.Tensor) -> LinearOp | None:
        return PackedLinear(weight) if self.pack_weights else None


@dataclass(frozen=True)
class TritonPlatform(TorchPlatform):
    """The Triton kernels for attention and the KV write, plain torch for the other ops; on
    CUDA, or on a CPU under Triton's interpreter (``TRITON_INTERPRET=1``, slow: tests only).
    Triton is imported when an op is first prepared, never at import."""

    name: ClassVar[str] = "triton"
    int8_kv_cache: ClassVar[bool] = False

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        from iterserve.kernels.triton_write_kv import write_kv

        write_kv(key, value, key_cache, value_cache, slot_mapping)

    def decode_attention(
        self,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_list: list[int],
        num_blocks: int,
        block_size: int,
        scale: float,
    ) -> DecodeAttention:
        num_decodes = len(seq_lens_list)
        query_start_loc = torch.arange(num_decodes + 1, device=seq_lens.device)
        return self.ragged_attention(
            block_tables,
            seq_lens,
            query_start_loc,
            [1] * num_decodes,
            seq_lens_list,
            num_blocks,
            block_size,
            scale,
        )

    def ragged_attention(
        self,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        query_lens: list[int],
        seq_lens_list: list[int],
        num_blocks: int,
        block_size: int,
        scale: float,
    ) -> RaggedAttention:
        # The kernel follows the tables unchecked: check them once per iteration, not per layer.
        check_block_tables(block_tables, seq_lens, num_blocks, block_size)
        max_query_len = max(query_lens, default=0)
        max_seq_len = max(seq_lens_list, default=0)
        return _triton_attend(
            block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len, scale
        )

    def static_decode_attention(
        self,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        max_seq_len: int,
        scale: float,
    ) -> RaggedAttention:
        # The split count and grid follow from the shapes and max_seq_len alone; each
        # program stops at its own row's seq_len, read on the device.
        return _triton_attend(block_tables, seq_lens, query_start_loc, 1, max_seq_len, scale)


def _triton_attend(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
) -> RaggedAttention:
    """The Triton paged-attention launch of one iteration, bound to its metadata."""
    from iterserve.kernels.triton_paged_attention import paged_attention

    def attend(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> torch.Tensor:
        return paged_attention(
            q,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            max_query_len,
            max_seq_len,
            scale,
        )

    return attend


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device``: triton imports and the device is a
    GPU, or a CPU under Triton's interpreter (``TRITON_INTERPRET=1``)."""
    if device.type != "cuda" and not (device.type == "cpu" and envs.triton_interpret()):
        return False
    return importlib.util.find_spec("triton") is not None


def select_platform(attention_backend: str, device: torch.device, dtype: torch.dtype) -> Platform:
    """The platform for ``--attention-backend`` on ``device`` in ``dtype`` (once, at start).

    ``auto`` picks :class:`TritonPlatform` on CUDA where triton imports, and
    :class:`CpuKernelsPlatform` on a CPU where the C kernels build for ``dtype`` (float32,
    bfloat16; see :mod:`iterserve.kernels.cpu_build`, which warns when they cannot be built),
    else :class:`TorchPlatform`; ``cpu`` insists on the C kernels, ``triton`` on Triton (on a
    CPU only under ``TRITON_INTERPRET=1``); ``torch`` is plain torch everywhere and never loads
    the C library.

    Raises:
        ValueError: for a backend that is not available for this device and dtype.
    """
    if attention_backend == "torch":
        return TorchPlatform()
    if attention_backend == "triton":
        if triton_available(device):
            return TritonPlatform()
        raise ValueError(
            f"attention backend 'triton' needs a CUDA device with triton installed, or on a CPU "
            f"Triton's interpreter (TRITON_INTERPRET=1, slow: for tests); got {device.type}"
        )
    if attention_backend == "auto" and device.type == "cuda" and triton_available(device):
        return TritonPlatform()
    if attention_backend in ("auto", "cpu"):
        if (
            device.type == "cpu"
            and cpu_kernel_available(dtype)
            and layer_ops_available(device, dtype)
        ):
            return CpuKernelsPlatform(pack_weights=weight_packing_available(device, dtype))
        if attention_backend == "auto":
            return TorchPlatform()
        raise ValueError(
            f"attention backend 'cpu' needs a CPU device, float32 or bfloat16 and a C compiler "
            f"(got {device.type}, {dtype}); use 'torch' or 'auto'"
        )
    raise ValueError(f"attention backend {attention_backend!r} is not available")
