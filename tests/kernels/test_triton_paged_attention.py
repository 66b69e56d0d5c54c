"""The Triton ragged paged-attention kernel against its torch reference computed in float64,
on random inputs (under Triton's interpreter without a GPU: tests/conftest.py sets
``TRITON_INTERPRET=1``). The interpreter computes with numpy, which has no bfloat16: bfloat16
runs only on a GPU. Shapes stay tiny because the interpreter runs every program in Python."""

from __future__ import annotations

import pytest
import torch

from iterserve.kernels.triton_paged_attention import (
    default_num_splits,
    paged_attention,
    paged_attention_reference,
)

# Error bound per dtype against the float64 reference: float32 dots in full precision; float16
# rounds the softmax weights before the P.V dot and the output (about 2 ** -11 relative each).
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def make_batch(
    reqs: list[tuple[int, int]],
    num_kv_heads: int,
    group: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """A ragged batch of ``(q_len, seq_len)`` requests whose blocks are scattered over the pool;
    table padding points at a NaN block, so reading past a context poisons the output."""
    gen = torch.Generator().manual_seed(len(reqs) * 1000 + sum(s for _, s in reqs))
    needed = [-(-seq_len // block_size) for _, seq_len in reqs]
    num_blocks = sum(needed) + 2
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0 is the NaN block
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    key_cache[:, 0] = float("nan")
    value_cache[:, 0] = float("nan")
    block_tables = torch.zeros(len(reqs), max(needed) + 1, dtype=torch.int64)
    used = 0
    for i, n in enumerate(needed):
        block_tables[i, :n] = perm[used : used + n]
        used += n
    query_lens = torch.tensor([q for q, _ in reqs])
    num_tokens = int(query_lens.sum())
    return dict(
        q=torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen).to(dtype),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        seq_lens=torch.tensor([s for _, s in reqs]),
        query_start_loc=torch.cat((torch.zeros(1, dtype=torch.int64), query_lens.cumsum(0))),
    )


CASES = [
    # (q_len, seq_len) per request, num_kv_heads, GQA group, block_size, head_dim, dtype, splits
    pytest.param([(1, 1), (1, 17), (1, 40)], 2, 1, 16, 64, torch.float32, 1, id="decode"),
    pytest.param([(1, 70), (1, 33)], 1, 8, 16, 64, torch.float32, 4, id="decode-split-gqa8"),
    pytest.param([(20, 20), (7, 37)], 1, 3, 32, 128, torch.float16, 1, id="prefill-midblock-fp16"),
    pytest.param(
        [(1, 50), (1, 3), (5, 21), (18, 45)], 2, 3, 16, 64, torch.float32, 2, id="mixed-split"
    ),
    pytest.param([(1, 90), (9, 40)], 1, 8, 32, 64, torch.float16, 4, id="mixed-split-fp16"),
    pytest.param([(3, 3), (1, 16), (16, 32)], 1, 1, 16, 128, torch.float32, 1, id="hd128"),
]


@pytest.mark.parametrize(
    "reqs, num_kv_heads, group, block_size, head_dim, dtype, num_splits", CASES
)
def test_matches_float64_reference(
    reqs: list[tuple[int, int]],
    num_kv_heads: int,
    group: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    num_splits: int,
) -> None:
    batch = make_batch(reqs, num_kv_heads, group, block_size, head_dim, dtype)
    scale = head_dim**-0.5
    out = paged_attention(
        **batch,
        max_query_len=max(q for q, _ in reqs),
        max_seq_len=max(s for _, s in reqs),
        scale=scale,
        num_splits=num_splits,
    )
    exact = paged_attention_reference(
        **{k: v.double() if v.is_floating_point() else v for k, v in batch.items()}, scale=scale
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), exact, **TOLERANCE[dtype])


def test_default_num_splits() -> None:
    # Many (request, KV head) programs or short contexts: no split; one long decode: 16.
    assert default_num_splits(64, 8, 8192) == 1
    assert default_num_splits(2, 8, 300) == 1
    assert default_num_splits(1, 8, 2048) == 4
    assert default_num_splits(1, 1, 1 << 20) == 16


def test_rejects_bad_inputs() -> None:
    batch = make_batch([(2, 5)], 1, 2, 16, 64, torch.float32)
    args = dict(max_query_len=2, max_seq_len=5, scale=0.125)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        paged_attention(**{**batch, "q": batch["q"].double()}, **args)
    with pytest.raises(ValueError, match="caches must be"):
        paged_attention(**{**batch, "key_cache": batch["key_cache"].half()}, **args)
    with pytest.raises(ValueError, match="block_size must be"):
        small_blocks = {k: batch[k].view(1, -1, 8, 64) for k in ("key_cache", "value_cache")}
        paged_attention(**{**batch, **small_blocks}, **args)
    with pytest.raises(ValueError, match="does not fit"):
        paged_attention(**{**batch, "q": torch.zeros(2, 2, 32)}, **args)
    with pytest.raises(ValueError, match="seq_lens must be int64"):
        paged_attention(**{**batch, "seq_lens": batch["seq_lens"].int()}, **args)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(**batch, **args, num_splits=3)
