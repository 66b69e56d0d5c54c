"""Swap copies through the staging rows (the CUDA side-stream path runs the same code, on a
GPU only): host block layout, runs of consecutive host blocks, exact round trips."""

from __future__ import annotations

import torch

from iterserve.executor.attention import KVCache, _runs


def test_runs_of_consecutive_ids_are_one_copy_each() -> None:
    assert _runs([4, 5, 6, 0, 2, 3]) == [(0, 4, 3), (3, 0, 1), (4, 2, 2)]
    assert _runs([]) == []


def test_swap_out_writes_host_blocks_in_place_and_swap_in_restores_them(
    device: torch.device,
) -> None:
    """On CUDA: pinned host pool, copies on the side stream (the compute stream's later work
    waits for them; the checks below read on the compute stream after synchronize)."""
    gen = torch.Generator().manual_seed(0)
    kv = KVCache(3, 10, 4, 2, 8, torch.float32, device, num_host_blocks=6)
    assert (kv.copy_stream is None) == (device.type == "cpu")
    assert kv.host is not None and kv.host.is_pinned() == (device.type == "cuda")
    for layer in range(3):
        kv.key[layer].copy_(torch.randn(kv.key[layer].shape, generator=gen))
        kv.value[layer].copy_(torch.randn(kv.value[layer].shape, generator=gen))
    host_before = kv.host.data_ptr()
    before = [
        (k.to("cpu", copy=True), v.to("cpu", copy=True))
        for k, v in zip(kv.key, kv.value, strict=True)
    ]
    pairs = [(7, 2), (1, 3), (4, 4), (9, 0)]  # host runs [2, 3, 4] and [0]
    kv.swap_out(pairs)
    # A later forward overwriting the swapped-out blocks runs after the gather.
    for layer in range(3):
        kv.key[layer][:, 7] = -1.0
    kv.synchronize()
    assert kv.host.data_ptr() == host_before
    for d, h in pairs:
        for layer in range(3):
            assert torch.equal(kv.host[h, layer, 0], before[layer][0][:, d])
            assert torch.equal(kv.host[h, layer, 1], before[layer][1][:, d])
    for layer in range(3):
        kv.key[layer].zero_()
        kv.value[layer].zero_()
    kv.swap_in([(h, d) for d, h in pairs])
    kv.synchronize()
    for d, _ in pairs:
        for layer in range(3):
            assert torch.equal(kv.key[layer][:, d].cpu(), before[layer][0][:, d])
            assert torch.equal(kv.value[layer][:, d].cpu(), before[layer][1][:, d])
    untouched = [b for b in range(10) if b not in {d for d, _ in pairs}]
    assert not kv.key[0][:, untouched].any()
    kv.swap_out([(1, 5)])
    kv.swap_in([(5, 9)])  # host block 5 read back on the same stream after it was written
    kv.synchronize()
    for layer in range(3):
        assert torch.equal(kv.key[layer][:, 9].cpu(), before[layer][0][:, 1])
