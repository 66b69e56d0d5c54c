"""Attention metadata of one iteration, the paged KV cache, and paged attention on a platform.

The batch is flattened: request ``i`` owns query rows ``query_start_loc[i] ..
query_start_loc[i + 1]`` and, after this iteration's KV is written, has ``seq_lens[i]`` tokens of
context in the blocks ``block_tables[i]``::

    query rows:  [ d0 | d1 | d2 | p0 p0 p0 p0 | p1 p1 ]      3 decodes, 2 prefill chunks
    query_start_loc = [0, 1, 2, 3, 7, 9]
    seq_lens        = [40, 17, 5, 4, 130]   (context incl. this iteration's tokens)

Each token's KV goes to ``slot_mapping[t] = block_id * block_size + offset``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import mmap
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from iterserve.kernels.kv_quant import row_width
from iterserve.kernels.platform import Platform


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
        max_seq_len_bound: set for a padded decode batch in static buffers (the CUDA-graph
            path, see :mod:`~iterserve.executor.cuda_graphs`): the static bound on
            ``seq_lens`` (``max_model_len``); attention then uses the platform's
            :meth:`~iterserve.kernels.platform.Platform.static_decode_attention`.
        num_padding: the last rows are padding (slot -1, seq_len 1, outputs discarded).
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int
    query_lens: list[int]
    seq_lens_list: list[int]
    max_seq_len_bound: int | None = None
    num_padding: int = 0


HUGE_PAGE = 2 << 20  # x86-64's transparent huge page


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in memory advised for transparent huge pages (``madvise`` with
    ``MADV_HUGEPAGE``, 2 MiB aligned), its pages touched now (committed at start, as
    ``torch.zeros`` would).

    Decode attention reads each sequence's blocks scattered over the whole pool: on 4 KiB pages
    nearly every block is a TLB miss and a page walk. On 2 MiB pages the pool's translations
    fit the TLB: decode attention at 32 x 320 tokens took 26-29 ms instead of 38-40 (30
    layers, SmolLM2-135M, docs/engine.md). Where the kernel does not honour the advice
    (``transparent_hugepage`` set to ``never``, or no THP) the memory is ordinary pages.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError, AttributeError):  # no THP here: ordinary pages
        buffer.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(buffer, dtype=torch.uint8)  # keeps the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start : start + nbytes].view(dtype).view(shape).zero_()


class KVCache:
    """Per-layer key and value caches, each ``[num_kv_heads, num_blocks, block_size, head_dim]``
    (``head_dim + 4`` int8 for an int8 cache: the values then their scale, see
    :mod:`~iterserve.kernels.kv_quant`).

    Head-major (not vLLM's ``[num_blocks, block_size, num_kv_heads, head_dim]``): gathering a
    batch's blocks with ``index_select`` on dim 1 then yields ``[num_kv_heads * num_seqs,
    seq_len, head_dim]`` contiguously, which batched matmuls read directly; with the
    block-major layout a transposing copy of all gathered KV was needed (measured 2x slower
    for decode attention on the development CPU, see docs/engine.md). Heads are also the axis
    tensor parallelism shards.

    The host swap pool is pinned on CUDA, and swap copies run on :attr:`copy_stream`, ordered
    by stream semantics rather than host waits: each swap starts after the work queued on the
    compute stream so far; the compute stream waits for a swap-out's gather (so a later
    forward cannot overwrite blocks before they are read) and for a swap-in's scatter (so
    the forward reading them sees them). All copies to and from host blocks run in order on
    that one stream, so a host block is never rewritten before an earlier copy of it has
    finished; the CPU never reads the host pool.
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
        width = row_width(head_dim, dtype)
        shape = (num_kv_heads, num_blocks, block_size, width)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.bytes_per_token = self.bytes_per_block(num_layers, 1, num_kv_heads, head_dim, dtype)
        if device.type == "cpu":
            pool = huge_page_zeros((2 * num_layers, *shape), dtype)
            # One view per layer by indexing (unbind's views could not be written in place
            # outside no_grad: "the output of a function that returns multiple views").
            self.key = [pool[i] for i in range(num_layers)]
            self.value = [pool[num_layers + i] for i in range(num_layers)]
        else:
            self.key = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.value = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # Host swap pool: [num_host_blocks, layers, (key, value), num_kv_heads, block, head_dim].
        pin = device.type == "cuda"
        host_shape = (num_host_blocks, num_layers, 2, num_kv_heads, block_size, width)
        self.host = (
            torch.zeros(host_shape, dtype=dtype, pin_memory=pin) if num_host_blocks else None
        )
        # Swap copies run on their own stream on CUDA (None elsewhere: copies are synchronous).
        self.copy_stream = torch.cuda.Stream(device) if pin and num_host_blocks else None

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block of a ``dtype`` cache takes across all layers, keys and values (int8:
        the rows' scales included)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * row_width(head_dim, dtype) * itemsize

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: ``(device_block_id, host_block_id)`` pairs.

        On CUDA the copies run on :attr:`copy_stream` (see the class docstring): the blocks are
        gathered into a device staging tensor after the forwards issued so far, the compute
        stream waits for that gather only (a later forward may then overwrite the blocks),
        and the staging rows go to pinned host blocks asynchronously.
        """
        if not pairs:
            return
        assert self.host is not None, "swap without a host pool"
        with self._on_copy_stream() as compute:
            device = self.key[0].device
            src = torch.tensor([d for d, _ in pairs], device=device)
            staging = self._staging(len(pairs), device)
            for layer, (k, v) in enumerate(zip(self.key, self.value, strict=True)):
                # [num_kv_heads, n, block, head_dim] -> rows [n, num_kv_heads, block, head_dim]
                staging[:, layer, 0] = k.index_select(1, src).transpose(0, 1)
                staging[:, layer, 1] = v.index_select(1, src).transpose(0, 1)
            self._compute_waits(compute)
            for row, host_start, n in _runs([h for _, h in pairs]):
                self.host[host_start : host_start + n].copy_(
                    staging[row : row + n], non_blocking=True
                )

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks: ``(host_block_id, device_block_id)`` pairs.

        On CUDA the copies run on :attr:`copy_stream` after the forwards issued so far (the
        device blocks may have been read by the last one), and the compute stream waits for
        them before the next forward reads the blocks.
        """
        if not pairs:
            return
        assert self.host is not None, "swap without a host pool"
        with self._on_copy_stream() as compute:
            device = self.key[0].device
            staging = self._staging(len(pairs), device)
            for row, host_start, n in _runs([h for h, _ in pairs]):
                staging[row : row + n].copy_(
                    self.host[host_start : host_start + n], non_blocking=True
                )
            dst = torch.tensor([d for _, d in pairs], device=device)
            for layer, (k, v) in enumerate(zip(self.key, self.value, strict=True)):
                k.index_copy_(1, dst, staging[:, layer, 0].transpose(0, 1))
                v.index_copy_(1, dst, staging[:, layer, 1].transpose(0, 1))
            self._compute_waits(compute)

    def synchronize(self) -> None:
        """Wait on the host until every swap copy issued so far has finished (timing only)."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    def _staging(self, n: int, device: torch.device) -> torch.Tensor:
        """[n, layers, 2, num_kv_heads, block, head_dim]: rows laid out as host blocks."""
        assert self.host is not None
        return torch.empty((n, *self.host.shape[1:]), dtype=self.host.dtype, device=device)

    @contextlib.contextmanager
    def _on_copy_stream(self) -> Iterator[torch.cuda.Stream | None]:
        """On CUDA: make the copy stream current, after the work queued on the compute stream
        (the one current on entry, yielded) so far: the blocks' last writes and reads.
        Elsewhere nothing (yields None)."""
        if self.copy_stream is None:
            yield None
            return
        compute = torch.cuda.current_stream(self.copy_stream.device)
        self.copy_stream.wait_stream(compute)
        with torch.cuda.stream(self.copy_stream):
            yield compute

    def _compute_waits(self, compute: torch.cuda.Stream | None) -> None:
        """The compute stream's later work waits for what the copy stream has queued so far
        (an event recorded now: later copies on the copy stream do not hold it up)."""
        if compute is not None and self.copy_stream is not None:
            compute.wait_stream(self.copy_stream)


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive ids: ``(index into ids, first id, length)``, so each run is one
    copy of contiguous host blocks."""
    runs: list[tuple[int, int, int]] = []
    for i, block in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, block, 1))
    return runs


class PagedAttention:
    """Paged attention of one iteration (the model's ``Attention``), on the ops of ``platform``.

    The KV write and the decodes run by the platform (:meth:`Platform.write_kv`,
    :meth:`Platform.decode_attention`, prepared here once per iteration: plain torch batches
    decodes by similar length, the C kernel reads every sequence's blocks in place). Prefill
    chunks run one request at a time through ``scaled_dot_product_attention`` with a causal
    mask shifted by the tokens already in the cache. A platform with a ragged op
    (:meth:`Platform.ragged_attention`: the Triton kernel) runs the whole batch, prefill
    chunks and decodes, in one launch per layer instead.

    Raises:
        ValueError: from the platform, for block tables pointing outside the pool.
    """

    def __init__(
        self, kv_cache: KVCache, metadata: AttentionMetadata, scale: float, platform: Platform
    ) -> None:
        self.kv_cache = kv_cache
        self.md = metadata
        self.scale = scale
        self.platform = platform
        # Rows whose KV is written: all (negative slots skipped by the op), or, on a padded
        # batch without the static op (eager only), the real rows.
        self._num_written: int | None = None
        if metadata.max_seq_len_bound is not None:
            self._ragged = platform.static_decode_attention(
                metadata.block_tables,
                metadata.seq_lens,
                metadata.query_start_loc,
                metadata.max_seq_len_bound,
                scale,
            )
            if self._ragged is not None:
                return
            self._num_written = len(metadata.query_lens) - metadata.num_padding
        # A platform with one op for the whole ragged batch runs prefill chunks and decodes in it.
        self._ragged = platform.ragged_attention(
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            metadata.query_lens,
            metadata.seq_lens_list,
            kv_cache.num_blocks,
            kv_cache.block_size,
            scale,
        )
        if self._ragged is not None:
            return
        nd = metadata.num_decodes
        self._decode = platform.decode_attention(
            metadata.block_tables[:nd],
            metadata.seq_lens[:nd],
            metadata.seq_lens_list[:nd],
            kv_cache.num_blocks,
            kv_cache.block_size,
            scale,
        )

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        key_cache = self.kv_cache.key[layer_idx]  # [num_kv_heads, num_blocks, block, head_dim]
        value_cache = self.kv_cache.value[layer_idx]
        n = self._num_written
        if n is None:
            self.platform.write_kv(k, v, key_cache, value_cache, self.md.slot_mapping)
        else:
            self.platform.write_kv(k[:n], v[:n], key_cache, value_cache, self.md.slot_mapping[:n])
        if self._ragged is not None:
            return self._ragged(q, key_cache, value_cache)
        nd = self.md.num_decodes
        if nd == len(self.md.query_lens):
            return self._decode(q, key_cache, value_cache)
        out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
        if nd:
            out[:nd] = self._decode(q[:nd], key_cache, value_cache)
        qsl = [0, *itertools.accumulate(self.md.query_lens)]  # host ints: no device read
        for i in range(nd, len(self.md.query_lens)):
            start, end = qsl[i], qsl[i + 1]
            seq_len = self.md.seq_lens_list[i]
            num_computed = seq_len - (end - start)
            if num_computed == 0:
                # The whole context is in this chunk: [num_kv_heads, q_len, head_dim]
                ks, vs = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
            else:
                ks, vs = self._gather(i, seq_len, key_cache, value_cache, q.dtype)
            out[start:end] = self._prefill(q[start:end], ks, vs, num_computed)
        return out

    def _gather(
        self,
        i: int,
        seq_len: int,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Request ``i``'s context from the cache: keys and values [num_kv_heads, seq_len,
        head_dim] in ``dtype`` (an int8 cache's rows dequantized)."""
        bs = self.kv_cache.block_size
        blocks = self.md.block_tables[i, : -(-seq_len // bs)]
        ks = key_cache.index_select(1, blocks).flatten(1, 2)
        vs = value_cache.index_select(1, blocks).flatten(1, 2)
        if key_cache.dtype == torch.int8:
            ks, vs = self.platform.dequantize_kv(ks, dtype), self.platform.dequantize_kv(vs, dtype)
        return ks[:, :seq_len], vs[:, :seq_len]

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
