"""The Triton KV write skips negative slots (padding rows of a CUDA-graph decode batch)."""

from __future__ import annotations

import torch

from iterserve.kernels.triton_write_kv import write_kv, write_kv_reference


def test_negative_slots_are_skipped(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(4, 2, 16, generator=gen).to(device)
    value = torch.randn(4, 2, 16, generator=gen).to(device)
    slots = torch.tensor([5, -1, 33, -1], device=device)
    caches = [torch.zeros(2, 3, 16, 16, device=device) for _ in range(4)]
    write_kv(key, value, caches[0], caches[1], slots)
    write_kv_reference(key, value, caches[2], caches[3], slots)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got, want)
    flat = caches[0].view(2, -1, 16)
    assert torch.equal(flat[:, 5], key[0]) and torch.equal(flat[:, 33], key[2])
    assert torch.count_nonzero(flat.abs().sum(-1)) == 2 * 2  # two slots, both heads
