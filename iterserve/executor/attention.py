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
    """Per-layer key and value caches, each ``[num_blocks, block_size, num_kv_heads, head_dim]``."""

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
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.bytes_per_token = self.bytes_per_block(num_layers, 1, num_kv_heads, head_dim, dtype)
        self.key = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # Host swap pool: one tensor of [num_host_blocks, layers x (key, value), block, ...].
        pin = device.type == "cuda"
        host_shape = (num_host_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
        self.host = (
            torch.zeros(host_shape, dtype=dtype, pin_memory=pin) if num_host_blocks else None
        )

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: ``(device_block_id, host_block_id)`` pairs."""
        if not pairs:
            return
        assert self.host is not None, "swap without a host pool"
        src = torch.tensor([d for d, _ in pairs], device=self.key[0].device)
        dst = torch.tensor([h for _, h in pairs])
        for layer, (k, v) in enumerate(zip(self.key, self.value, strict=True)):
            self.host[dst, layer, 0] = k[src].to("cpu")
            self.host[dst, layer, 1] = v[src].to("cpu")

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks: ``(host_block_id, device_block_id)`` pairs."""
        if not pairs:
            return
        assert self.host is not None, "swap without a host pool"
        src = torch.tensor([h for h, _ in pairs])
        dst = torch.tensor([d for _, d in pairs], device=self.key[0].device)
        blocks = self.host[src]  # [num_pairs, layers, 2, block_size, heads, head_dim]
        for layer, (k, v) in enumerate(zip(self.key, self.value, strict=True)):
            k[dst] = blocks[:, layer, 0].to(k.device, non_blocking=True)
            v[dst] = blocks[:, layer, 1].to(v.device, non_blocking=True)

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes across all layers, keys and values."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


class TorchAttention:
    """Paged attention in plain torch: ``scaled_dot_product_attention`` over gathered blocks.

    Decodes are batched: their blocks are gathered into ``[num_decodes, max_len, ...]`` and
    masked past each sequence's length. Prefill chunks run one request at a time with a causal
    mask shifted by the tokens already in the cache.
    """

    def __init__(self, kv_cache: KVCache, metadata: AttentionMetadata, scale: float) -> None:
        self.kv_cache = kv_cache
        self.md = metadata
        self.scale = scale
        num_decodes = metadata.num_decodes
        if num_decodes:
            decode_lens = metadata.seq_lens[:num_decodes]
            max_len = max(metadata.seq_lens_list[:num_decodes])
            num_blocks = -(-max_len // kv_cache.block_size)
            self._decode_blocks = metadata.block_tables[:num_decodes, :num_blocks]
            self._decode_len = num_blocks * kv_cache.block_size
            # [num_decodes, 1, 1, padded_len]: True where the key exists.
            self._decode_mask = (torch.arange(self._decode_len)[None, :] < decode_lens[:, None])[
                :, None, None, :
            ]

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        key_cache = self.kv_cache.key[layer_idx]
        value_cache = self.kv_cache.value[layer_idx]
        num_heads, head_dim = q.shape[1], q.shape[2]
        # Write this iteration's keys and values into their slots.
        key_cache.view(-1, *k.shape[1:])[self.md.slot_mapping] = k
        value_cache.view(-1, *v.shape[1:])[self.md.slot_mapping] = v
        out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
        nd = self.md.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], key_cache, value_cache)
        qsl = self.md.query_start_loc.tolist() if nd < len(self.md.query_lens) else []
        for i in range(nd, len(self.md.query_lens)):
            start, end = qsl[i], qsl[i + 1]
            seq_len = self.md.seq_lens_list[i]
            num_computed = seq_len - (end - start)
            if num_computed == 0:
                ks, vs = k[start:end], v[start:end]  # the whole context is in this chunk
            else:
                ks, vs = self._gather(i, seq_len, key_cache, value_cache)
            out[start:end] = self._prefill(q[start:end], ks, vs, num_computed)
        assert out.shape[1:] == (num_heads, head_dim)
        return out

    def _gather(
        self, i: int, seq_len: int, key_cache: torch.Tensor, value_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.kv_cache.block_size
        blocks = self.md.block_tables[i, : -(-seq_len // bs)]
        ks = key_cache[blocks].flatten(0, 1)[:seq_len]  # [seq_len, num_kv_heads, head_dim]
        vs = value_cache[blocks].flatten(0, 1)[:seq_len]
        return ks, vs

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_computed: int
    ) -> torch.Tensor:
        # q [q_len, H, D]; k, v [seq_len, Hkv, D]; query j sits at position num_computed + j.
        qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if num_computed == 0:
            o = F.scaled_dot_product_attention(
                qt, kt, vt, is_causal=True, scale=self.scale, enable_gqa=True
            )
        else:
            q_len, seq_len = q.shape[0], k.shape[0]
            key_pos = torch.arange(seq_len, device=q.device)
            query_pos = num_computed + torch.arange(q_len, device=q.device)
            mask = key_pos[None, :] <= query_pos[:, None]  # [q_len, seq_len]
            o = F.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=mask, scale=self.scale, enable_gqa=True
            )
        return o.transpose(0, 1)

    def _decode(
        self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
    ) -> torch.Tensor:
        # q [num_decodes, H, D] -> gather [num_decodes, padded_len, Hkv, D]
        ks = key_cache[self._decode_blocks].flatten(1, 2)
        vs = value_cache[self._decode_blocks].flatten(1, 2)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [num_decodes, H, 1, D]
            ks.transpose(1, 2),  # [num_decodes, Hkv, padded_len, D]
            vs.transpose(1, 2),
            attn_mask=self._decode_mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return o.squeeze(2)


def get_attention_backend(name: str) -> type[TorchAttention]:
    """The attention backend class for ``--attention-backend`` (``auto`` picks torch for now).

    Raises:
        ValueError: for a backend that is not available.
    """
    if name in ("auto", "torch"):
        return TorchAttention
    raise ValueError(f"attention backend {name!r} is not available")
