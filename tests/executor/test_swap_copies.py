"""Swap copies through the staging rows (the CUDA side-stream path runs the same code, on a
GPU only): host block layout, runs of consecutive host blocks, exact round trips."""

from __future__ import annotations

import torch

from iterserve.executor.attention import KVCache, _runs


def test_runs_of_consecutive_ids_are_one_copy_each() -> None:
    assert _runs([4, 5, 6, 0, 2, 3]) == [(0, 4, 3), (3, 0, 1), (4, 2, 2)]
    assert _runs([]) == []


def test_swap_out_writes_host_blocks_in_place_and_swap_in_restores_them() -> None:
    gen = torch.Generator().manual_seed(0)
    kv = KVCache(3, 10, 4, 2, 8, torch.float32, torch.device("cpu"), num_host_blocks=6)
    assert kv.copy_stream is None  # CPU: synchronous copies
    for layer in range(3):
        kv.key[layer].copy_(torch.randn(kv.key[layer].shape, generator=gen))
        kv.value[layer].copy_(torch.randn(kv.value[layer].shape, generator=gen))
    assert kv.host is not None
    host_before = kv.host.data_ptr()
    pairs = [(7, 2), (1, 3), (4, 4), (9, 0)]  # host runs [2, 3, 4] and [0]
    kv.swap_out(pairs)
    assert kv.host.data_ptr() == host_before
    for d, h in pairs:
        for layer in range(3):
            assert torch.equal(kv.host[h, layer, 0], kv.key[layer][:, d])
            assert torch.equal(kv.host[h, layer, 1], kv.value[layer][:, d])
    saved = {
        d: [(kv.key[i][:, d].clone(), kv.value[i][:, d].clone()) for i in range(3)]
        for d, _ in pairs
    }
    for layer in range(3):
        kv.key[layer].zero_()
        kv.value[layer].zero_()
    kv.swap_in([(h, d) for d, h in pairs])
    kv.synchronize()
    for d, _ in pairs:
        for layer in range(3):
            assert torch.equal(kv.key[layer][:, d], saved[d][layer][0])
            assert torch.equal(kv.value[layer][:, d], saved[d][layer][1])
    untouched = [b for b in range(10) if b not in {d for d, _ in pairs}]
    assert not kv.key[0][:, untouched].any()
