"""Decode iterations in static buffers, padded to batch-size buckets, replayed as CUDA graphs.

A pure-decode iteration (every request one query token, every one sampled) of at most the
largest bucket runs in the smallest bucket ``>=`` its batch (vLLM's scheme: 1, 2, 4, 8, then
every 8 up to ``max_num_seqs``). Its inputs are copied into :class:`StaticDecodeInputs`,
buffers allocated once at their largest size, so a graph captured at start over
``buffers[:bucket]`` reads each step's values from the same addresses::

    rows      0 .. n-1: the requests          n .. bucket-1: padding
    input_ids token                            0
    positions seq_len - 1                      0
    slot      its KV slot                      -1   (the KV write skips it)
    seq_lens  seq_len                          1    (attends to key 0 of block 0: harmless)
    tables    its block table (zero-padded)    0    (width: max_model_len / block_size)
    query_start_loc = arange(bucket + 1)       (constant)

Attention runs through the platform's
:meth:`~iterserve.kernels.platform.Platform.static_decode_attention` (grid and split count
from the shapes and ``max_model_len`` only); the logits of the padding rows are discarded.
Prefill and mixed iterations stay eager. Tables are checked on the host while filling the
buffers (no device sync).

:class:`DecodeGraphs` captures one graph per bucket (CUDA only) and replays them; without
capture (CPU tests, or ``--enforce-eager`` never builds one) the same padded forward runs
eagerly, which is what the CPU tests compare with the unpadded path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from iterserve.engine.outputs import ScheduledRequest
from iterserve.executor.attention import AttentionMetadata
from iterserve.kernels.paged_decode_attention import check_block_tables

logger = logging.getLogger(__name__)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch-size buckets: 1, 2, 4, then multiples of 8, up to the first ``>= max_num_seqs``."""
    candidates = [1, 2, 4, *range(8, max_num_seqs + 8, 8)]
    below = [b for b in candidates if b < max_num_seqs]
    return [*below, next(b for b in candidates if b >= max_num_seqs)]


def bucket_for(num_rows: int, buckets: list[int]) -> int | None:
    """The smallest bucket ``>= num_rows`` (buckets ascending), or None past the largest."""
    return next((b for b in buckets if b >= num_rows), None)


def is_graph_decode(scheduled: list[ScheduledRequest]) -> bool:
    """Whether the iteration is pure decode (one token each, each sampled)."""
    return bool(scheduled) and all(s.num_scheduled_tokens == 1 and s.sample for s in scheduled)


class StaticDecodeInputs:
    """The padded decode batch's buffers, allocated once at ``max_rows``.

    Args:
        max_rows: the largest bucket.
        max_model_len: tokens per sequence (tables are ``ceil(max_model_len / block_size)``
            wide; attention's static bound).
        block_size: tokens per KV block.
        num_blocks: the pool's blocks (tables are checked against it).
        device: where the buffers live.
    """

    def __init__(
        self,
        max_rows: int,
        max_model_len: int,
        block_size: int,
        num_blocks: int,
        device: torch.device,
    ) -> None:
        self.max_rows = max_rows
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.width = -(-max_model_len // block_size)
        i64 = torch.int64
        self.input_ids = torch.zeros(max_rows, dtype=i64, device=device)
        self.positions = torch.zeros(max_rows, dtype=i64, device=device)
        self.slot_mapping = torch.full((max_rows,), -1, dtype=i64, device=device)
        self.seq_lens = torch.ones(max_rows, dtype=i64, device=device)
        self.block_tables = torch.zeros(max_rows, self.width, dtype=i64, device=device)
        self.query_start_loc = torch.arange(max_rows + 1, dtype=i64, device=device)

    def fill(self, scheduled: list[ScheduledRequest], bucket: int) -> list[int]:
        """Copy one pure-decode iteration into rows ``[:bucket]``, padding the rest.

        Returns:
            The rows' context lengths as Python ints (padding rows 1).

        Raises:
            ValueError: more requests than ``bucket``, a request that is no single-token
                decode, or a block table pointing outside the pool or past ``max_model_len``.
        """
        n = len(scheduled)
        if n > bucket or bucket > self.max_rows:
            raise ValueError(f"{n} requests do not fit bucket {bucket} (max {self.max_rows})")
        bs = self.block_size
        ids, pos, slots, lens = [0] * bucket, [0] * bucket, [-1] * bucket, [1] * bucket
        tables = torch.zeros(bucket, self.width, dtype=torch.int64)
        for i, s in enumerate(scheduled):
            if s.num_scheduled_tokens != 1:
                raise ValueError(f"request {s.request_id} is not a single-token decode")
            if len(s.block_table) > self.width:
                raise ValueError(f"request {s.request_id}'s table exceeds max_model_len")
            p = s.num_computed_tokens
            ids[i], pos[i], lens[i] = s.token_ids[0], p, p + 1
            slots[i] = s.block_table[p // bs] * bs + p % bs
            tables[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int64)
        host_lens = torch.tensor(lens, dtype=torch.int64)
        check_block_tables(tables, host_lens, self.num_blocks, bs)  # on the host: no sync
        # Pageable sources: each copy returns once its source is staged (no device sync).
        for buffer, host in (
            (self.input_ids, torch.tensor(ids, dtype=torch.int64)),
            (self.positions, torch.tensor(pos, dtype=torch.int64)),
            (self.slot_mapping, torch.tensor(slots, dtype=torch.int64)),
            (self.seq_lens, host_lens),
            (self.block_tables, tables),
        ):
            buffer[:bucket].copy_(host, non_blocking=True)
        return lens

    def metadata(
        self, bucket: int, seq_lens_list: list[int], num_padding: int
    ) -> AttentionMetadata:
        """Attention metadata over rows ``[:bucket]`` (views of the buffers)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            num_decodes=bucket,
            query_lens=[1] * bucket,
            seq_lens_list=seq_lens_list,
            max_seq_len_bound=self.max_model_len,
            num_padding=num_padding,
        )


# (input_ids, positions, metadata) -> logits [rows, vocab]: the model's forward and LM head.
DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class DecodeGraphs:
    """Padded decode forwards per bucket: replayed CUDA graphs once :meth:`capture` ran,
    eager otherwise.

    Args:
        inputs: the static buffers (their device is the forward's).
        buckets: ascending batch sizes.
        forward: runs the model and its LM head over the given rows.
    """

    def __init__(
        self, inputs: StaticDecodeInputs, buckets: list[int], forward: DecodeForward
    ) -> None:
        if not buckets or buckets != sorted(buckets) or buckets[-1] > inputs.max_rows:
            raise ValueError(f"buckets must ascend up to {inputs.max_rows}, got {buckets}")
        self.inputs = inputs
        self.buckets = buckets
        self.forward = forward
        # bucket -> (graph, its static logits output [bucket, vocab])
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def bucket_for(self, scheduled: list[ScheduledRequest]) -> int | None:
        """The bucket this iteration runs in, or None (not pure decode, or too many rows)."""
        if not is_graph_decode(scheduled):
            return None
        return bucket_for(len(scheduled), self.buckets)

    def run(self, scheduled: list[ScheduledRequest], bucket: int) -> torch.Tensor:
        """Logits [len(scheduled), vocab] of one pure-decode iteration in ``bucket``: the
        captured graph's replay (its output buffer: read before the next replay), or the
        eager padded forward where nothing was captured."""
        n = len(scheduled)
        seq_lens_list = self.inputs.fill(scheduled, bucket)
        captured = self.graphs.get(bucket)
        if captured is not None:
            graph, logits = captured
            graph.replay()
            return logits[:n]
        if self.graphs:
            raise RuntimeError(
                f"bucket {bucket} was not captured (captured: {sorted(self.graphs)})"
            )
        return self._forward(bucket, seq_lens_list, bucket - n)[:n]

    def _forward(self, bucket: int, seq_lens_list: list[int], num_padding: int) -> torch.Tensor:
        md = self.inputs.metadata(bucket, seq_lens_list, num_padding)
        return self.forward(self.inputs.input_ids[:bucket], self.inputs.positions[:bucket], md)

    def capture(self) -> None:
        """Capture one graph per bucket, largest first, in one memory pool (CUDA only; the
        buffers hold padding only, so capture writes no KV). Logs the buckets and the time.

        Raises:
            RuntimeError: not on CUDA, or a capture failed (the message names the bucket and
                ``--enforce-eager``); nothing falls back silently.
        """
        device = self.inputs.input_ids.device
        if device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device, got {device}")
        self.inputs.slot_mapping.fill_(-1)
        self.inputs.seq_lens.fill_(1)
        self.inputs.block_tables.zero_()
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        before = torch.cuda.memory_reserved(device)
        for bucket in reversed(self.buckets):
            padding = [1] * bucket
            try:
                # Warm up on a side stream (Triton compiles, lazy inits run), as torch's docs do.
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    self._forward(bucket, padding, bucket)
                torch.cuda.current_stream(device).wait_stream(side)
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(bucket, padding, bucket)
            except Exception as e:
                raise RuntimeError(
                    f"CUDA graph capture of decode bucket {bucket} failed ({e}); "
                    f"--enforce-eager runs decode iterations eagerly"
                ) from e
            self.graphs[bucket] = (graph, logits)
        torch.cuda.synchronize(device)
        logger.info(
            "captured CUDA graphs for decode buckets %s in %.1f s (%d MiB of graph memory)",
            self.buckets,
            time.perf_counter() - start,
            (torch.cuda.memory_reserved(device) - before) >> 20,
        )
