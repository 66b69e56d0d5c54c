"""Building blocks of Llama-family models over a flattened ragged batch ``[num_tokens, ...]``.

Linear layers follow Megatron-LM's tensor-parallel split (Shoeybi et al., 2019): a
column-parallel layer shards its output features, a row-parallel layer its input features
and all-reduces its output; the embedding and the LM head split the vocabulary
(:mod:`~iterserve.models.parallel`). Each weight loader cuts the shard its rank owns, from a
lazy safetensors slice when the loader passes one (so a rank reads only its shard). With one
rank (``SINGLE``) every layer holds everything and nothing communicates.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.kernels.platform import LinearOp, Platform
from iterserve.kernels.quantized_linear import (
    Int8Linear,
    QuantizedRows,
    int8_linear_for,
    rms_norm_quantize,
)
from iterserve.models.parallel import SINGLE, TPGroup, divide, kv_head_range

# A checkpoint tensor as the loader hands it: a tensor, or a lazy safetensors slice
# (``safe_open(...).get_slice(name)``) from which a rank reads only its shard.
Loadable = Any


def narrow(loaded: Loadable, dim: int, start: int, length: int) -> torch.Tensor:
    """``loaded.narrow(dim, start, length)``; from a safetensors slice only these elements are
    read."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    return loaded[(slice(None),) * dim + (slice(start, start + length),)]


def materialize(loaded: Loadable) -> torch.Tensor:
    """The whole tensor (for the parameters every rank holds in full: norms, biases)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


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

    def forward_quantized(
        self, x: torch.Tensor, residual: torch.Tensor | None, smooth: torch.Tensor | None
    ) -> tuple[QuantizedRows, torch.Tensor]:
        """:meth:`forward_residual` (:meth:`forward` when ``residual`` is None: the residual
        stream is then ``x``) with the normalised rows quantized in the same pass for an
        :class:`~iterserve.kernels.quantized_linear.Int8Linear` whose smoothing is ``smooth``
        (CPU, bfloat16; :func:`~iterserve.kernels.quantized_linear.rms_norm_quantize`)."""
        return rms_norm_quantize(x, self.weight, self.eps, residual, smooth), (
            x if residual is None else residual
        )


class PackableLinear(nn.Module):
    """A linear layer whose weight a platform can repack into its own layout once loaded."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    packed: LinearOp | None = None

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        return self.project(x, self.bias)

    def project(self, x: torch.Tensor | QuantizedRows, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T (+ bias)`` by the packed op, or by torch before packing. ``x`` may come
        quantized already (:class:`~iterserve.kernels.quantized_linear.QuantizedRows`, from a
        fused norm or SwiGLU) where :meth:`int8_op` is not None for its rows.

        Raises:
            ValueError: quantized rows for a size this layer runs no int8 kernel at.
        """
        if isinstance(x, QuantizedRows):
            op = self.int8_op(x.num_rows)
            if op is None:
                raise ValueError(f"quantized rows but no int8 kernel at {x.num_rows} rows")
            return op(x, bias)
        if self.packed is not None:
            return self.packed(x, bias)
        return F.linear(x, self.weight, bias)

    def int8_op(self, rows: int) -> Int8Linear | None:
        """The int8 kernel this layer runs for ``rows`` rows (``--quantization int8``), or None."""
        return int8_linear_for(self.packed, rows)

    def pack_weight(self, platform: Platform) -> None:
        """Repack the loaded weight where ``platform`` packs weights and free the plain one:
        load first, pack once (the layer cannot load weights afterwards)."""
        packed = platform.pack_linear_weight(self.weight)
        if packed is not None:
            self.use_op(packed)

    def use_op(self, op: LinearOp) -> None:
        """Run ``op(x, bias)`` from now on (a packed or quantized copy of the weight) and free
        the plain weight."""
        self.packed = op
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)


class ColumnParallelLinear(PackableLinear):
    """``y = x W^T (+ b)`` with W ``[out_features / tp.size, in_features]`` on each rank (no
    communication: the output stays sharded by columns)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__()
        self.tp = tp
        out = divide(out_features, tp.size, "out_features")
        self.weight = nn.Parameter(torch.empty(out, in_features))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None

    def weight_loader(
        self, param: nn.Parameter, loaded: Loadable, shard_id: str | None = None
    ) -> None:
        size = param.shape[0]
        param.data.copy_(narrow(loaded, 0, self.tp.rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul
    (gate and up of SwiGLU). Shard ``i`` occupies rows ``sum(sizes[:i]) .. +sizes[i]``."""

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool = False, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__(in_features, sum(output_sizes), bias, tp)
        self.output_sizes = [divide(s, tp.size, "intermediate_size") for s in output_sizes]

    def weight_loader(
        self, param: nn.Parameter, loaded: Loadable, shard_id: str | None = None
    ) -> None:
        idx = int(shard_id) if shard_id is not None else 0
        size = self.output_sizes[idx]
        offset = sum(self.output_sizes[:idx])
        param.data.narrow(0, offset, size).copy_(narrow(loaded, 0, self.tp.rank * size, size))


class QKVParallelLinear(PackableLinear):
    """Fused q, k and v projections; rows ``[q heads | k heads | v heads] x head_dim`` of this
    rank's heads: ``num_heads / tp.size`` query heads and the KV heads of
    :func:`~iterserve.models.parallel.kv_head_range` (replicated above ``num_kv_heads``)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads = divide(num_heads, tp.size, "num_attention_heads")
        self.kv_head_start, self.num_kv_heads = kv_head_range(num_kv_heads, tp)
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        out = self.q_size + 2 * self.kv_size
        self.weight = nn.Parameter(torch.empty(out, hidden_size))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None

    def weight_loader(
        self, param: nn.Parameter, loaded: Loadable, shard_id: str | None = None
    ) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp.rank * self.q_size
        else:
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size, start = self.kv_size, self.kv_head_start * self.head_dim
        param.data.narrow(0, offset, size).copy_(narrow(loaded, 0, start, size))


class RowParallelLinear(PackableLinear):
    """``y = x W^T (+ b)`` with W ``[out_features, in_features / tp.size]`` on each rank: the
    input comes sharded by columns, the partial outputs are summed over the ranks (one
    all-reduce of ``[num_tokens, out_features]``), then the bias is added once."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(
            torch.empty(out_features, divide(in_features, tp.size, "in_features"))
        )
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        y = self.tp.all_reduce(self.project(x, None))
        return y + self.bias if self.bias is not None else y

    def weight_loader(
        self, param: nn.Parameter, loaded: Loadable, shard_id: str | None = None
    ) -> None:
        if param.dim() == 1:  # the bias is added once, not sharded
            param.data.copy_(materialize(loaded))
            return
        size = param.shape[1]
        param.data.copy_(narrow(loaded, 1, self.tp.rank * size, size))


class VocabParallelEmbedding(nn.Module):
    """Token embeddings with the vocabulary split by rows: rank ``r`` holds rows
    ``[r * per_rank, (r + 1) * per_rank)`` (``per_rank = ceil(vocab / tp.size)``, the last
    rank's rows beyond the vocabulary zero). Each rank embeds the ids it holds, zeroes the
    others and the ranks sum (one all-reduce of ``[num_tokens, hidden]``).

    The same shard is the LM head when the embeddings are tied: :meth:`logits` gives this
    rank's columns of the logits.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [num_tokens] int64 -> [num_tokens, hidden]."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))

    def weight_loader(
        self, param: nn.Parameter, loaded: Loadable, shard_id: str | None = None
    ) -> None:
        load_vocab_rows(param, loaded, self.vocab_start, self.vocab_size)


def load_vocab_rows(param: nn.Parameter, loaded: Loadable, start: int, vocab_size: int) -> None:
    """Copy rows ``[start, start + len(param))`` of a ``[vocab, hidden]`` checkpoint tensor into
    ``param``, leaving rows past ``vocab_size`` (the last rank's padding) zero."""
    count = max(0, min(param.shape[0], vocab_size - start))
    param.data.zero_()
    if count:
        param.data.narrow(0, 0, count).copy_(narrow(loaded, 0, start, count))


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al., 2021, "RoFormer"), Hugging Face's half-split layout.

    ``inv_freq`` and ``attention_scaling`` come from transformers' rope functions for the
    model's ``rope_parameters`` (RoFormer's own, the default, from ``build_rotary``), so every
    rope type they implement statically is supported.
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
