"""Building blocks of Llama-family models over a flattened ragged batch ``[num_tokens, ...]``.

Linear layers follow Megatron-LM's tensor-parallel split (Shoeybi et al., 2019): a
column-parallel layer shards its output features, a row-parallel layer its input features
(and would all-reduce its output). With ``tp_size=1`` (today) each rank holds everything; the
weight loaders already cut the shard a rank owns, so tensor parallelism only has to pass a
rank and add the all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.kernels.layer_ops import (
    rms_norm_cpu,
    rotary_embedding_cpu,
    silu_and_mul_cpu,
    silu_and_mul_reference,
)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich, 2019), accumulated in float32.

    ``use_cpu_kernel`` (set by :meth:`LlamaForCausalLM.use_cpu_kernels`) runs the C kernel,
    which also fuses the residual add of :meth:`forward_residual`.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_cpu_kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        if self.use_cpu_kernel:
            return rms_norm_cpu(x, self.weight, self.eps)
        # torch's fused kernel accumulates in float32 like Hugging Face's three-step version
        # (bit-identical in float32) without materialising float32 copies of x.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def forward_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; the kernel updates ``residual`` in place."""
        if self.use_cpu_kernel:
            return rms_norm_cpu(x, self.weight, self.eps, residual), residual
        residual = x + residual
        return self.forward(residual), residual


# Batch size oneDNN is told to expect when packing (measured on the development CPU: packed
# weights beat F.linear at every batch from 1 to 512, the hint changes little).
PACK_BATCH_HINT = 64


def weight_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :meth:`PackableLinear.pack_weight` works here: CPU, bfloat16, oneDNN."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out_features, in_features] reordered once into oneDNN's blocked layout for
    :func:`packed_linear` (what ``torch.compile``'s CPU freezing pass does). ``F.linear``
    reorders plain weights on every call: 1.1-2x slower at decode batch sizes."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with ``packed = pack_weight(weight)``; x [num_tokens, in]."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class PackableLinear(nn.Module):
    """A linear layer whose weight can be packed for oneDNN once loaded."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    packed_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def pack_weight(self) -> None:
        """Pack the loaded weight (:func:`pack_weight`) and free the plain one: load first,
        pack once (the layer cannot load weights afterwards)."""
        self.packed_weight = pack_weight(self.weight)
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)


class ColumnParallelLinear(PackableLinear):
    """``y = x W^T (+ b)`` with W ``[out_features / tp_size, in_features]`` on each rank."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        if out_features % tp_size:
            raise ValueError(f"out_features {out_features} not divisible by tp_size {tp_size}")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = nn.Parameter(torch.empty(out_features // tp_size, in_features))
        self.bias = nn.Parameter(torch.empty(out_features // tp_size)) if bias else None

    def _shard(self, loaded: torch.Tensor, size: int) -> torch.Tensor:
        return loaded.narrow(0, self.tp_rank * size, size)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None
    ) -> None:
        param.data.copy_(self._shard(loaded, param.shape[0]))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul
    (gate and up of SwiGLU). Shard ``i`` occupies rows ``sum(sizes[:i]) .. +sizes[i]``."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__(in_features, sum(output_sizes), bias, tp_rank, tp_size)
        self.output_sizes = [s // tp_size for s in output_sizes]

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None
    ) -> None:
        idx = int(shard_id) if shard_id is not None else 0
        size = self.output_sizes[idx]
        offset = sum(self.output_sizes[:idx])
        param.data.narrow(0, offset, size).copy_(self._shard(loaded, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k and v projections; rows ``[q heads | k heads | v heads] x head_dim``."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        if num_heads % tp_size or num_kv_heads % tp_size:
            raise ValueError(
                f"heads ({num_heads}, {num_kv_heads}) not divisible by tp_size {tp_size}"
            )
        out = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden_size, out, bias, tp_rank, tp_size)
        self.q_size = num_heads // tp_size * head_dim
        self.kv_size = num_kv_heads // tp_size * head_dim

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None
    ) -> None:
        offsets = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size)}
        offsets["v"] = (self.q_size + self.kv_size, self.kv_size)
        offset, size = offsets[str(shard_id)]
        param.data.narrow(0, offset, size).copy_(self._shard(loaded, size))


class RowParallelLinear(PackableLinear):
    """``y = x W^T (+ b)`` with W ``[out_features, in_features / tp_size]`` on each rank;
    with tensor parallelism the partial outputs are summed across ranks."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        if in_features % tp_size:
            raise ValueError(f"in_features {in_features} not divisible by tp_size {tp_size}")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp_size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None
    ) -> None:
        if param.dim() == 1:  # the bias is added once, not sharded
            param.data.copy_(loaded)
            return
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * size, size))


Rotate = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al., 2021, "RoFormer"), Hugging Face's half-split layout.

    ``inv_freq`` and ``attention_scaling`` come from transformers' rope functions for the
    model's ``rope_parameters``, so every rope type they implement statically is supported.
    cos/sin are computed in float32 for ``max_position`` positions and cached in the model's
    dtype (``Module.to`` casts them, as Hugging Face casts them before use).
    """

    cos: torch.Tensor  # [max_position, head_dim] float32
    sin: torch.Tensor

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_position: int) -> None:
        super().__init__()
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())  # [max_position, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        self.register_buffer("cos", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_scaling, persistent=False)

    def rotate(self, positions: torch.Tensor, dtype: torch.dtype, use_cpu_kernel: bool) -> Rotate:
        """The function that rotates one layer's ``(q, k)`` at ``positions`` ([num_tokens]
        int64): q [num_tokens, num_heads, head_dim], k [num_tokens, num_kv_heads, head_dim]."""
        if use_cpu_kernel:
            cos, sin = self.cos.to(dtype), self.sin.to(dtype)  # no-ops: the model's dtype

            def rotate_in_place(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
                rotary_embedding_cpu(q, k, positions, cos, sin)
                return q, k

            return rotate_in_place
        c, s = self.cos_sin(positions, dtype)
        return lambda q, k: (apply_rotary(q, c, s), apply_rotary(k, c, s))

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at ``positions`` ([num_tokens] int64), each [num_tokens, 1, head_dim]."""
        return (
            self.cos[positions].to(dtype).unsqueeze(1),
            self.sin[positions].to(dtype).unsqueeze(1),
        )


def silu_and_mul(gate_up: torch.Tensor, use_cpu_kernel: bool) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up``: [num_tokens, 2 * inter] -> [num_tokens, inter]."""
    return silu_and_mul_cpu(gate_up) if use_cpu_kernel else silu_and_mul_reference(gate_up)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:  # x [num_tokens, num_heads, head_dim]
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
