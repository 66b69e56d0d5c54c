"""Paged decode attention in plain torch (length groups + batched matmuls) against its
reference on random inputs, and the length grouping that bounds its padding."""

from __future__ import annotations

import pytest
import torch

from iterserve.kernels.grouped_decode_attention import (
    grouped_decode_attention,
    length_groups,
    plan_decode_groups,
)
from iterserve.kernels.paged_decode_attention import paged_decode_attention_reference

# bfloat16 scores and probabilities enter the matmuls rounded (the reference stays float32).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64


def random_case(
    gen: torch.Generator, dtype: torch.dtype, seq_lens: list[int], block_size: int
) -> tuple[torch.Tensor, ...]:
    """q [num_seqs, heads, dim], caches, block tables (blocks scattered over the pool) and
    seq_lens."""
    width = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * width + 3
    shape = (NUM_KV_HEADS, num_blocks, block_size, HEAD_DIM)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * width]
    block_tables = perm.view(len(seq_lens), width).contiguous()
    q = torch.randn(len(seq_lens), NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    return q, key_cache, value_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int64)


def test_length_groups_bound_the_padding() -> None:
    assert length_groups([5, 37, 1, 200]) == [[0, 1, 2, 3]]  # alike: one group, batch order
    groups = length_groups([700, 5, 1500, 300, 40, 260])
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert groups == [[1, 4, 5], [3], [0], [2]]  # 5..260 | 300 | 700 | 1500
    assert length_groups([]) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "seq_lens",
    [[1, 2, 17, 37, 5], [700, 5, 1500, 300, 40, 260]],
    ids=["one-group", "four-groups"],
)
@pytest.mark.parametrize("block_size", [1, 16])
def test_grouped_decode_matches_reference(
    dtype: torch.dtype, seq_lens: list[int], block_size: int
) -> None:
    gen = torch.Generator().manual_seed(len(seq_lens) * 100 + block_size)
    q, kc, vc, bt, lens = random_case(gen, dtype, seq_lens, block_size)
    groups = plan_decode_groups(bt, lens, seq_lens, block_size)
    assert len(groups) == len(length_groups(seq_lens))
    out = grouped_decode_attention(q, groups, kc, vc, HEAD_DIM**-0.5)
    ref = paged_decode_attention_reference(q, kc, vc, bt, lens, HEAD_DIM**-0.5)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
