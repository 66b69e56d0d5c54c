"""The C paged decode attention kernel against its torch reference on random inputs."""

from __future__ import annotations

import pytest
import torch
from paged_cases import random_decode_case

from iterserve.kernels.paged_decode_attention import (
    check_block_tables,
    paged_decode_attention_cpu,
    paged_decode_attention_reference,
)

pytestmark = pytest.mark.usefixtures("cpu_kernels")

TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    # SmolLM2-135M (9/3/64), head_dim 128, no GQA, group 8, group 9 and odd head_dims
    # (the portable path), MQA.
    [(9, 3, 64), (8, 2, 128), (4, 4, 64), (16, 2, 64), (9, 1, 64), (6, 2, 16), (4, 2, 80)],
)
@pytest.mark.parametrize("block_size", [1, 12, 16, 32])  # 12: not a power of two
def test_kernel_matches_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    gen = torch.Generator().manual_seed(num_heads * 1000 + head_dim + block_size)
    seq_lens = [1, 2, block_size, block_size + 1, 37, 300, 5]
    q, kc, vc, bt, lens = random_decode_case(
        gen, dtype, seq_lens, num_heads, num_kv_heads, head_dim, block_size
    )
    scale = head_dim**-0.5
    ref = paged_decode_attention_reference(q, kc, vc, bt, lens, scale)
    out = paged_decode_attention_cpu(torch.empty_like(ref), q, kc, vc, bt, lens, scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_kernel_with_extreme_scores_stays_finite() -> None:
    """Large logits (one key dominating) and tiny ones: softmax must neither overflow nor NaN."""
    gen = torch.Generator().manual_seed(7)
    q, kc, vc, bt, lens = random_decode_case(gen, torch.bfloat16, [50, 700], 9, 3, 64, 16)
    q = q * 60.0
    ref = paged_decode_attention_reference(q, kc, vc, bt, lens, 1.0)
    out = paged_decode_attention_cpu(torch.empty_like(ref), q, kc, vc, bt, lens, 1.0)
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_empty_batch_returns_out_untouched() -> None:
    q = torch.empty(0, 9, 64)
    kc = torch.zeros(3, 4, 16, 64)
    out = torch.empty(0, 9, 64)
    tables = torch.zeros(0, 1, dtype=torch.int64)
    lens = torch.zeros(0, dtype=torch.int64)
    assert paged_decode_attention_cpu(out, q, kc, kc, tables, lens, 0.125) is out


def test_launcher_rejects_what_the_kernel_cannot_take() -> None:
    gen = torch.Generator().manual_seed(0)
    q, kc, vc, bt, lens = random_decode_case(gen, torch.float32, [5, 9], 9, 3, 64, 16)
    out = torch.empty(q.shape)
    with pytest.raises(ValueError, match="one dtype"):
        paged_decode_attention_cpu(out, q, kc.bfloat16(), vc, bt, lens, 1.0)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        paged_decode_attention_cpu(out.half(), q.half(), kc.half(), vc.half(), bt, lens, 1.0)
    with pytest.raises(ValueError, match="share"):
        paged_decode_attention_cpu(out, q, kc[:2], vc[:2], bt, lens, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        paged_decode_attention_cpu(out, q, kc.transpose(1, 2), vc.transpose(1, 2), bt, lens, 1.0)
    with pytest.raises(ValueError, match="int64"):
        paged_decode_attention_cpu(out, q, kc, vc, bt.int(), lens, 1.0)
    with pytest.raises(ValueError, match="one row per sequence"):
        paged_decode_attention_cpu(out, q, kc, vc, bt[:1], lens, 1.0)


def test_check_block_tables() -> None:
    tables = torch.tensor([[3, 1, 0], [2, 0, 0]])
    check_block_tables(tables, torch.tensor([9, 4]), num_blocks=4, block_size=4)
    # Unused entries past a sequence's blocks may hold anything.
    check_block_tables(torch.tensor([[3, 99, -1]]), torch.tensor([4]), 4, 4)
    with pytest.raises(ValueError, match="block ids"):
        check_block_tables(tables, torch.tensor([9, 4]), num_blocks=3, block_size=4)
    with pytest.raises(ValueError, match="seq_lens"):
        check_block_tables(tables, torch.tensor([13, 4]), num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="seq_lens"):
        check_block_tables(tables, torch.tensor([0, 4]), num_blocks=4, block_size=4)
