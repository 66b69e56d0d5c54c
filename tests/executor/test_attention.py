"""Paged attention on the platforms (plain torch; the C KV write and decode kernel; the Triton
kernels) against dense causal attention on random inputs."""

from __future__ import annotations

import pytest
import torch

from iterserve.engine.outputs import ScheduledRequest
from iterserve.engine.sampling_params import SamplingParams
from iterserve.executor.attention import KVCache, PagedAttention
from iterserve.executor.model_runner import prepare_inputs
from iterserve.kernels.kv_quant import dequantize_kv_rows, quantize_kv_rows
from iterserve.kernels.paged_decode_attention import cpu_kernel_available
from iterserve.kernels.platform import (
    CpuKernelsPlatform,
    Platform,
    TorchPlatform,
    TritonPlatform,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_computed: int
) -> torch.Tensor:
    """q [q_len, H, D] at positions num_computed.., k/v [seq_len, Hkv, D] -> [q_len, H, D]."""
    group = NUM_HEADS // NUM_KV_HEADS
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * HEAD_DIM**-0.5
    q_pos = num_computed + torch.arange(q.shape[0])
    mask = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


# (num_computed, num_new): decodes, a fresh prefill, and prefill chunks over cached context.
SHAPES = [(5, 1), (37, 1), (0, 1), (0, 23), (12, 9), (40, 17)]
# Decodes of very different lengths (several length groups) next to a prefill chunk.
MIXED_DECODES = [(700, 1), (5, 1), (1500, 1), (300, 1), (40, 1), (12, 9)]


PLATFORMS = [TorchPlatform(), CpuKernelsPlatform(pack_weights=False)]


def stored(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """What a cache of ``cache_dtype`` holds for rows ``x``."""
    return quantize_kv_rows(x) if cache_dtype == torch.int8 else x


def read_back(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """What attention reads for rows ``x`` from a cache of ``cache_dtype``."""
    return dequantize_kv_rows(stored(x, cache_dtype), x.dtype) if cache_dtype == torch.int8 else x


@pytest.mark.parametrize("platform", PLATFORMS, ids=["torch", "cpu"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shapes", [SHAPES, MIXED_DECODES], ids=["small", "mixed-lengths"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8], ids=["f32", "int8"])
def test_paged_attention_matches_dense(
    platform: Platform,
    block_size: int,
    seed: int,
    shapes: list[tuple[int, int]],
    cache_dtype: torch.dtype,
) -> None:
    """With an int8 cache (--kv-cache-dtype int8), what attention reads from the cache is the
    rows quantized (every decode, a one-token prompt included, and a chunk over cached
    context), while a fresh prefill attends over its own unquantized keys and values; the
    slots hold the quantized rows."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in shapes) + 8
    kv = KVCache(
        1, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, cache_dtype, torch.device("cpu")
    )
    free = torch.randperm(num_blocks, generator=gen).tolist()
    full_k, full_v, requests = [], [], []
    for i, (num_computed, num_new) in enumerate(shapes):
        seq_len = num_computed + num_new
        table = [free.pop() for _ in range(-(-seq_len // block_size))]
        k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        for p in range(num_computed):  # context already in the cache
            kv.key[0][:, table[p // block_size], p % block_size] = stored(k[p], cache_dtype)
            kv.value[0][:, table[p // block_size], p % block_size] = stored(v[p], cache_dtype)
        full_k.append(k)
        full_v.append(v)
        requests.append(
            ScheduledRequest(str(i), [0] * num_new, num_computed, table, True, SamplingParams())
        )
    inputs = prepare_inputs(requests, block_size)
    order = [int(s.request_id) for s in inputs.sampled]  # decodes first
    q = torch.randn(int(inputs.input_ids.shape[0]), NUM_HEADS, HEAD_DIM, generator=gen)
    new_k = torch.cat([full_k[i][shapes[i][0] :] for i in order])
    new_v = torch.cat([full_v[i][shapes[i][0] :] for i in order])
    out = PagedAttention(kv, inputs.metadata, HEAD_DIM**-0.5, platform)(0, q, new_k, new_v)
    starts = inputs.metadata.query_start_loc.tolist()
    for row, i in enumerate(order):
        s, e = starts[row], starts[row + 1]
        k, v = full_k[i], full_v[i]
        if shapes[i][0] or shapes[i][1] == 1:  # read from the cache (one token: a decode)
            k, v = read_back(k, cache_dtype), read_back(v, cache_dtype)
        ref = dense_reference(q[s:e], k, v, shapes[i][0])
        torch.testing.assert_close(out[s:e], ref, atol=1e-5, rtol=1e-5)
    # Every new token's KV landed in its slot.
    for i in order:
        num_computed, num_new = shapes[i]
        table = requests[i].block_table
        for p in range(num_computed, num_computed + num_new):
            slot = (table[p // block_size], p % block_size)
            assert torch.equal(kv.key[0][:, slot[0], slot[1]], stored(full_k[i][p], cache_dtype))
            assert torch.equal(kv.value[0][:, slot[0], slot[1]], stored(full_v[i][p], cache_dtype))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors: Triton interpreted")
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("shapes", [SHAPES, MIXED_DECODES], ids=["small", "mixed-lengths"])
def test_triton_paged_attention_matches_dense(
    block_size: int, shapes: list[tuple[int, int]]
) -> None:
    """The Triton platform runs the whole batch, prefill chunks and decodes, in its ragged kernel
    (under Triton's interpreter, set by tests/conftest.py; block sizes of 16 and more only); the
    long decodes of ``MIXED_DECODES`` take its split-KV path."""
    test_paged_attention_matches_dense(TritonPlatform(), block_size, 0, shapes, torch.float32)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8], ids=["f32", "int8"])
def test_swap_out_and_in_round_trips_blocks(device: torch.device, cache_dtype: torch.dtype) -> None:
    """int8 rows carry their scales in their last bytes: swapped with them."""
    gen = torch.Generator().manual_seed(3)
    kv = KVCache(2, 8, 4, NUM_KV_HEADS, HEAD_DIM, cache_dtype, device, num_host_blocks=4)
    for layer in range(2):
        for cache in (kv.key[layer], kv.value[layer]):
            rows = torch.randn((*cache.shape[:3], HEAD_DIM), generator=gen)
            cache.copy_(stored(rows, cache_dtype))
    saved = [(kv.key[i][:, [5, 2]].clone(), kv.value[i][:, [5, 2]].clone()) for i in range(2)]
    kv.swap_out([(5, 3), (2, 0)])  # device block -> host block
    for layer in range(2):  # the device blocks are reused by someone else meanwhile
        kv.key[layer][:, [5, 2]] = 0.0
        kv.value[layer][:, [5, 2]] = 0.0
    kv.swap_in([(3, 7), (0, 1)])  # host block -> (new) device block
    for layer in range(2):
        assert torch.equal(kv.key[layer][:, [7, 1]], saved[layer][0])
        assert torch.equal(kv.value[layer][:, [7, 1]], saved[layer][1])


def test_cpu_backend_refuses_a_table_pointing_outside_the_pool() -> None:
    assert cpu_kernel_available(torch.float32), "the C kernels must build here"
    kv = KVCache(1, 4, 4, NUM_KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    request = ScheduledRequest("0", [0], 6, [1, 9], True, SamplingParams())  # block 9 of 4
    inputs = prepare_inputs([request], 4)
    with pytest.raises(ValueError, match="block ids"):
        PagedAttention(kv, inputs.metadata, 1.0, CpuKernelsPlatform(pack_weights=False))
