"""Building blocks of Llama-family models over a flattened ragged batch ``[num_tokens, ...]``.

Linear layers follow Megatron-LM's tensor-parallel split (Shoeybi et al., 2019): a
column-parallel layer shards its output features, a row-parallel layer its input features
(and would all-reduce its output). With ``tp_size=1`` (today) each rank holds everything; the
weight loaders already cut the shard a rank owns, so tensor parallelism only has to pass a
rank and add the all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.kernels.platform import LinearOp, Platform


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich, 2019), accumulated in float32, by the
    platform's op (whose C kernel also fuses the residual add of :meth:`forward_residual`)."""

    def __init__(self, hidden_size: int, eps: float, platform: Platform) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.platform = platform

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        return self.platform.rms_norm(x, self.weight, self.eps)

    def forward_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; the platform may update ``residual`` in
        place."""
        return self.platform.rms_norm_residual(x, residual, self.weight, self.eps)


class PackableLinear(nn.Module):
    """A linear layer whose weight a platform can repack into its own layout once loaded."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    packed: LinearOp | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x, self.bias)
        return F.linear(x, self.weight, self.bias)

    def pack_weight(self, platform: Platform) -> None:
        """Repack the loaded weight where ``platform`` packs weights and free the plain one:
        load first, pack once (the layer cannot load weights afterwards)."""
        packed = platform.pack_linear_weight(self.weight)
        if packed is None:
            return
        self.packed = packed
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

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, each [max_position, head_dim] in ``dtype`` (no copy in the model's)."""
        return self.cos.to(dtype), self.sin.to(dtype)
