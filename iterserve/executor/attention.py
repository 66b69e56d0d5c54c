"""Attention metadata of one iteration and the torch paged-attention backend.

The batch is flattened: request ``i`` owns query rows ``query_start_loc[i] ..
query_start_loc[i + 1]`` and, after this iteration's KV is written, has ``seq_lens[i]`` tokens of
context in the blocks ``block_tables[i]``::

    query rows:  [ d0 | d1 | d2 | p0 p0 p0 p0 | p1 p1 ]      3 decodes, 2 prefill chunks
    query_start_loc = [0, 1, 2, 3, 7, 9]
    seq_lens        = [40, 17, 5, 4, 130]   (context incl. this iteration's tokens)

Each token's KV goes to ``slot_mapping[t] = block_id * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from iterserve.kernels.layer_ops import layer_ops_available, reshape_and_cache_cpu
from iterserve.kernels.paged_decode_attention import (
    check_block_tables,
    cpu_kernel_available,
    paged_decode_attention_cpu,
)


@dataclass(frozen=True)
class AttentionMetadata:
    """Tensors describing one iteration's attention.

    Attributes:
        slot_mapping: [num_tokens] int64, KV slot of each query token.
        query_start_loc: [num_reqs + 1] int64 (cu_seqlens_q).
        seq_lens: [num_reqs] int64, context length after this iteration.
        block_tables: [num_reqs, max_num_blocks] int64 (rows padded with 0).
        num_decodes: the first ``num_decodes`` requests have exactly one query token.
        query_lens / seq_lens_list: the same numbers as Python ints.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int
    query_lens: list[int]
    seq_lens_list: list[int]


class KVCache:
    """Per-layer key and value caches, each ``[num_kv_heads, num_blocks, block_size, head_dim]``.

    Head-major (not vLLM's ``[num_blocks, block_size, num_kv_heads, head_dim]``): gathering a
    batch's blocks with ``index_select`` on dim 1 then yields ``[num_kv_heads * num_seqs,
    seq_len, head_dim]`` contiguously, which batched matmuls read directly; with the
    block-major layout a transposing copy of all gathered KV was needed (measured 2x slower
    for decode attention on the development CPU, see docs/engine.md). Heads are also the axis
    tensor parallelism shards.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        num_host_blocks: int = 0,
    ) -> None:
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.bytes_per_token = self.bytes_per_block(num_layers, 1, num_kv_heads, head_dim, dtype)
        self.key = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # Host swap pool: [num_host_blocks, layers, (key, value), num_kv_heads, block, head_dim].
        pin = device.type == "cuda"
        host_shape = (num_host_blocks, num_layers, 2, num_kv_heads, block_size, head_dim)
        self.host = (
            torch.zeros(host_shape, dtype=dtype, pin_memory=pin) if num_host_blocks else None
        )

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes across all layers, keys and values."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: ``(device_block_id, host_block_id)`` pairs."""
        if not pairs:
            return
        assert self.host is not None, "swap without a host pool"
        src = torch.tensor([d for d, _ in pairs], device=self.key[0].device)
        dst = torch.tensor([h for _, h in pairs])
        for layer, (k, v) in enumerate(zip(self.key, self.value, strict=True)):
            # [num_kv_heads, n, block, head_dim] -> [n, num_kv_heads, block, head_dim]
            self.host[dst, layer, 0] = k.index_select(1, src).transpose(0, 1).to("cpu")
            self.host[dst, layer, 1] = v.index_select(1, src).transpose(0, 1).to("cpu")

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks: ``(host_block_id, device_block_id)`` pairs."""
        if not pairs:
            return
        assert self.host is not None, "swap without a host pool"
        src = torch.tensor([h for h, _ in pairs])
        dst = torch.tensor([d for _, d in pairs], device=self.key[0].device)
        blocks = self.host[src]  # [n, layers, 2, num_kv_heads, block, head_dim]
        for layer, (k, v) in enumerate(zip(self.key, self.value, strict=True)):
            k[:, dst] = blocks[:, layer, 0].transpose(0, 1).to(k.device, non_blocking=True)
            v[:, dst] = blocks[:, layer, 1].transpose(0, 1).to(v.device, non_blocking=True)


# A decode joins a length group while its context is at most this factor times the group's
# shortest (and the group's padding stays bounded by it), or within this many tokens.
MAX_PAD_FACTOR = 2.0
MIN_PAD_TOKENS = 256


def length_groups(seq_lens: list[int]) -> list[list[int]]:
    """Split decodes (by batch index) into groups of similar context length.

    Decode attention pads every sequence of a group to the group's longest, so one 4,000-token
    context in a batch of 300-token ones would make every sequence pay for 4,000. Sorted by
    length, a new group starts when a context exceeds ``MAX_PAD_FACTOR`` times the group's
    shortest and ``MIN_PAD_TOKENS`` more than it: padding costs at most 2x (and one group, the
    common case, when lengths are alike).

    Returns:
        Lists of batch indices; one list holding every index when all lengths are alike.
    """
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    groups: list[list[int]] = []
    shortest = 0
    for i in order:
        n = seq_lens[i]
        if groups and (n <= shortest * MAX_PAD_FACTOR or n - shortest <= MIN_PAD_TOKENS):
            groups[-1].append(i)
        else:
            groups.append([i])
            shortest = n
    if len(groups) == 1:
        return [list(range(len(seq_lens)))]
    return groups


@dataclass(frozen=True)
class _DecodeGroup:
    rows: list[int]
    index: torch.Tensor | None  # [len(rows)] batch indices; None: all decodes in order
    blocks: torch.Tensor  # [len(rows) * num_blocks]
    padded_len: int
    pad: torch.Tensor  # [1, len(rows), 1, padded_len], True past each sequence's end


class TorchAttention:
    """Paged attention in plain torch.

    Decodes are batched by similar length (:func:`length_groups`): the blocks of a group are
    gathered into ``[num_kv_heads * group_size,
    padded_len, head_dim]`` and two batched matmuls (grouped-query heads share their KV head)
    attend, masked past each sequence's length, with the softmax in float32. Prefill chunks
    run one request at a time through ``scaled_dot_product_attention`` with a causal mask
    shifted by the tokens already in the cache.
    """

    def __init__(self, kv_cache: KVCache, metadata: AttentionMetadata, scale: float) -> None:
        self.kv_cache = kv_cache
        self.md = metadata
        self.scale = scale
        self._decode_groups = [
            self._decode_group(rows)
            for rows in length_groups(metadata.seq_lens_list[: metadata.num_decodes])
        ]

    def _decode_group(self, rows: list[int]) -> _DecodeGroup:
        """Gather plan of the decodes ``rows`` (indices into the batch), padded to the longest."""
        md, bs = self.md, self.kv_cache.block_size
        device = md.seq_lens.device
        index = torch.tensor(rows, device=device)
        lens = md.seq_lens[index]
        num_blocks = -(-max(md.seq_lens_list[r] for r in rows) // bs)
        padded_len = num_blocks * bs
        keys = torch.arange(padded_len, device=device)
        return _DecodeGroup(
            rows=rows,
            index=None if rows == list(range(md.num_decodes)) else index,
            # [len(rows) * num_blocks]: the blocks to gather, sequence after sequence.
            blocks=md.block_tables[index, :num_blocks].flatten(),
            padded_len=padded_len,
            # [1, len(rows), 1, padded_len]: True past the end of each sequence.
            pad=(keys[None, :] >= lens[:, None])[None, :, None, :],
        )

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        key_cache = self.kv_cache.key[layer_idx]  # [num_kv_heads, num_blocks, block, head_dim]
        value_cache = self.kv_cache.value[layer_idx]
        self._write_kv(k, v, key_cache, value_cache)
        nd = self.md.num_decodes
        if nd == len(self.md.query_lens):
            return self._decode(q, key_cache, value_cache)
        out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
        if nd:
            out[:nd] = self._decode(q[:nd], key_cache, value_cache)
        qsl = self.md.query_start_loc.tolist()
        for i in range(nd, len(self.md.query_lens)):
            start, end = qsl[i], qsl[i + 1]
            seq_len = self.md.seq_lens_list[i]
            num_computed = seq_len - (end - start)
            if num_computed == 0:
                # The whole context is in this chunk: [num_kv_heads, q_len, head_dim]
                ks, vs = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
            else:
                ks, vs = self._gather(i, seq_len, key_cache, value_cache)
            out[start:end] = self._prefill(q[start:end], ks, vs, num_computed)
        return out

    def _write_kv(
        self, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
    ) -> None:
        """Write this iteration's keys and values ([num_tokens, num_kv_heads, head_dim]) into
        their slots."""
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        slots = self.md.slot_mapping
        key_cache.view(num_kv_heads, -1, head_dim)[:, slots] = k.transpose(0, 1)
        value_cache.view(num_kv_heads, -1, head_dim)[:, slots] = v.transpose(0, 1)

    def _gather(
        self, i: int, seq_len: int, key_cache: torch.Tensor, value_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.kv_cache.block_size
        blocks = self.md.block_tables[i, : -(-seq_len // bs)]
        # [num_kv_heads, seq_len, head_dim]
        ks = key_cache.index_select(1, blocks).flatten(1, 2)[:, :seq_len]
        vs = value_cache.index_select(1, blocks).flatten(1, 2)[:, :seq_len]
        return ks, vs

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_computed: int
    ) -> torch.Tensor:
        # q [q_len, H, D]; k, v [Hkv, seq_len, D]; query j sits at position num_computed + j.
        # SDPA's fused CPU (flash) kernel needs 4-D inputs and no enable_gqa; otherwise it
        # falls back to the math path (measured 3-4x slower at 512 tokens): expand KV to
        # every query head (cheap next to the attention itself) and add a batch dim.
        qt = q.transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        group = q.shape[1] // k.shape[0]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        k, v = k.unsqueeze(0), v.unsqueeze(0)  # [1, H, seq_len, D]
        if num_computed == 0:
            o = F.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=self.scale)
        else:
            q_len, seq_len = q.shape[0], k.shape[2]
            key_pos = torch.arange(seq_len, device=q.device)
            query_pos = num_computed + torch.arange(q_len, device=q.device)
            mask = key_pos[None, :] <= query_pos[:, None]  # [q_len, seq_len]
            o = F.scaled_dot_product_attention(qt, k, v, attn_mask=mask, scale=self.scale)
        return o[0].transpose(0, 1)

    def _decode(
        self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
    ) -> torch.Tensor:
        # q [num_decodes, num_heads, head_dim]; one gather + two bmm per length group.
        if len(self._decode_groups) == 1 and self._decode_groups[0].index is None:
            return self._decode_group_attend(q, self._decode_groups[0], key_cache, value_cache)
        out = torch.empty_like(q)
        for g in self._decode_groups:
            assert g.index is not None
            out[g.index] = self._decode_group_attend(q[g.index], g, key_cache, value_cache)
        return out

    def _decode_group_attend(
        self, q: torch.Tensor, g: _DecodeGroup, key_cache: torch.Tensor, value_cache: torch.Tensor
    ) -> torch.Tensor:
        nd, num_heads, head_dim = q.shape  # q [num_decodes in group, num_heads, head_dim]
        num_kv_heads = key_cache.shape[0]
        group = num_heads // num_kv_heads
        length = g.padded_len
        # [num_kv_heads * nd, padded_len, head_dim], contiguous after the gather.
        ks = key_cache.index_select(1, g.blocks).view(-1, length, head_dim)
        vs = value_cache.index_select(1, g.blocks).view(-1, length, head_dim)
        # Query heads of one KV head side by side: [num_kv_heads * nd, group, head_dim]
        qg = (q * self.scale).view(nd, num_kv_heads, group, head_dim).transpose(0, 1)
        scores = torch.bmm(qg.reshape(-1, group, head_dim), ks.transpose(1, 2))
        scores = scores.float().view(num_kv_heads, nd, group, length)
        probs = scores.masked_fill(g.pad, float("-inf")).softmax(dim=-1)
        probs = probs.to(q.dtype).view(-1, group, length)
        o = torch.bmm(probs, vs)  # [num_kv_heads * num_decodes, group, head_dim]
        return (
            o.view(num_kv_heads, nd, group, head_dim)
            .transpose(0, 1)
            .reshape(nd, num_heads, head_dim)
        )


class CpuAttention(TorchAttention):
    """:class:`TorchAttention` with decodes by the fused C kernel
    (:func:`~iterserve.kernels.paged_decode_attention.paged_decode_attention_cpu`), which reads
    every sequence's blocks in place: no gather copy, no padding, no length groups, and the
    KV write by :func:`~iterserve.kernels.layer_ops.reshape_and_cache_cpu`. Prefill chunks run
    as in :class:`TorchAttention`. float32 and bfloat16 only.
    """

    def __init__(self, kv_cache: KVCache, metadata: AttentionMetadata, scale: float) -> None:
        self.kv_cache = kv_cache
        self.md = metadata
        self.scale = scale
        nd = metadata.num_decodes
        self._block_tables = metadata.block_tables[:nd]
        self._seq_lens = metadata.seq_lens[:nd]
        # The kernel follows the tables unchecked: check them once per iteration, not per layer.
        check_block_tables(
            self._block_tables, self._seq_lens, kv_cache.num_blocks, kv_cache.block_size
        )

    def _write_kv(
        self, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
    ) -> None:
        reshape_and_cache_cpu(k, v, key_cache, value_cache, self.md.slot_mapping)

    def _decode(
        self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
    ) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype)  # [num_decodes, num_heads, head_dim]
        return paged_decode_attention_cpu(
            out, q, key_cache, value_cache, self._block_tables, self._seq_lens, self.scale
        )


def get_attention_backend(
    name: str, device: torch.device, dtype: torch.dtype
) -> type[TorchAttention]:
    """The attention backend class for ``--attention-backend``.

    ``auto`` picks :class:`CpuAttention` on a CPU where its kernel builds for ``dtype`` (see
    :mod:`iterserve.kernels.cpu_build`), else :class:`TorchAttention`; ``cpu`` insists on the
    kernel; ``torch`` is plain torch everywhere.

    Raises:
        ValueError: for a backend that is not available for this device and dtype.
    """
    if name == "torch":
        return TorchAttention
    if name in ("auto", "cpu"):
        if cpu_kernel_available(dtype) and layer_ops_available(device, dtype):
            return CpuAttention
        if name == "auto":
            return TorchAttention
        raise ValueError(
            f"attention backend 'cpu' needs a CPU device, float32 or bfloat16 and a C compiler "
            f"(got {device.type}, {dtype}); use 'torch' or 'auto'"
        )
    raise ValueError(f"attention backend {name!r} is not available")
