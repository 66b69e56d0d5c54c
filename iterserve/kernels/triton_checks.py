"""Correctness checks of the Triton kernels against their torch references, without pytest.

The pytest tests (tests/kernels/test_triton_*.py, under Triton's interpreter on a CPU) and
``python -m benchmarks.gpu`` (compiled, on a GPU) run the same cases through
:func:`check_paged_attention` and :func:`check_write_kv`. Inputs are generated on the CPU
from a seeded generator and moved to the device, so both see the same numbers.

The interpreter computes with numpy, which has no bfloat16: :func:`gpu_attention_cases` adds
each case in bfloat16 for a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from iterserve.kernels.triton_paged_attention import paged_attention, paged_attention_reference
from iterserve.kernels.triton_write_kv import write_kv, write_kv_reference

# Error bound per dtype against the float64 reference: float32 dots in full precision; float16
# rounds the softmax weights before the P.V dot and the output (about 2 ** -11 relative each);
# bfloat16 keeps 8 significant bits (2 ** -9 relative per rounding, 4x float16's): 4x its bound
# plus margin.
TOLERANCE: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-4},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2},
}


@dataclass(frozen=True)
class AttentionCase:
    """One ragged batch: ``(q_len, seq_len)`` tokens per request and the kernel's shape."""

    name: str
    reqs: tuple[tuple[int, int], ...]
    num_kv_heads: int
    group: int  # query heads per KV head (GQA)
    block_size: int
    head_dim: int
    dtype: torch.dtype
    num_splits: int


ATTENTION_CASES = (
    AttentionCase("decode", ((1, 1), (1, 17), (1, 40)), 2, 1, 16, 64, torch.float32, 1),
    AttentionCase("decode-split-gqa8", ((1, 70), (1, 33)), 1, 8, 16, 64, torch.float32, 4),
    AttentionCase("prefill-midblock-fp16", ((20, 20), (7, 37)), 1, 3, 32, 128, torch.float16, 1),
    AttentionCase(
        "mixed-split", ((1, 50), (1, 3), (5, 21), (18, 45)), 2, 3, 16, 64, torch.float32, 2
    ),
    AttentionCase("mixed-split-fp16", ((1, 90), (9, 40)), 1, 8, 32, 64, torch.float16, 4),
    AttentionCase("hd128", ((3, 3), (1, 16), (16, 32)), 1, 1, 16, 128, torch.float32, 1),
)

WRITE_KV_DTYPES = (torch.float32, torch.float16)


def gpu_attention_cases() -> tuple[AttentionCase, ...]:
    """:data:`ATTENTION_CASES` plus each of them in bfloat16 (a GPU only)."""
    bf16 = tuple(
        replace(c, name=f"{c.name}-bf16", dtype=torch.bfloat16)
        for c in ATTENTION_CASES
        if c.dtype != torch.bfloat16
    )
    return ATTENTION_CASES + bf16


def make_batch(
    reqs: tuple[tuple[int, int], ...] | list[tuple[int, int]],
    num_kv_heads: int,
    group: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """A ragged batch of ``(q_len, seq_len)`` requests whose blocks are scattered over the pool;
    table padding points at a NaN block, so reading past a context poisons the output.

    Returns the keyword arguments ``q``, ``key_cache``, ``value_cache``, ``block_tables``,
    ``seq_lens`` and ``query_start_loc`` of :func:`paged_attention`, on ``device``.
    """
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
    batch = dict(
        q=torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen).to(dtype),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        seq_lens=torch.tensor([s for _, s in reqs]),
        query_start_loc=torch.cat((torch.zeros(1, dtype=torch.int64), query_lens.cumsum(0))),
    )
    return {k: v.to(device) for k, v in batch.items()}


def check_paged_attention(case: AttentionCase, device: torch.device | str = "cpu") -> float:
    """Run :func:`paged_attention` on ``case`` and compare it with the float64 reference.

    Returns:
        The largest absolute error.

    Raises:
        AssertionError: the output is not ``case.dtype`` or misses :data:`TOLERANCE`.
    """
    batch = make_batch(
        case.reqs,
        case.num_kv_heads,
        case.group,
        case.block_size,
        case.head_dim,
        case.dtype,
        device,
    )
    scale = case.head_dim**-0.5
    out = paged_attention(
        **batch,
        max_query_len=max(q for q, _ in case.reqs),
        max_seq_len=max(s for _, s in case.reqs),
        scale=scale,
        num_splits=case.num_splits,
    )
    # The reference on the CPU: float64 on a GPU can be slow or missing.
    exact = paged_attention_reference(
        **{k: v.cpu().double() if v.is_floating_point() else v.cpu() for k, v in batch.items()},
        scale=scale,
    )
    assert out.dtype == case.dtype, f"output is {out.dtype}, not {case.dtype}"
    got = out.cpu().double()
    tolerance = TOLERANCE[case.dtype]
    torch.testing.assert_close(got, exact, atol=tolerance["atol"], rtol=tolerance["rtol"])
    return float((got - exact).abs().max())


def check_write_kv(dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
    """Write 7 tokens' keys and values (values a strided view into a fused qkv output, as the
    model passes them) with :func:`write_kv` and with the reference: the caches must be equal
    (it copies), and exactly the written rows non-zero.

    Raises:
        AssertionError: the caches differ.
    """
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_kv_heads, head_dim, num_blocks, block_size = 7, 3, 64, 5, 16
    qkv = torch.randn(num_tokens, 2 + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    qkv = qkv.to(device)
    key, value = qkv[:, 2 : 2 + num_kv_heads], qkv[:, 2 + num_kv_heads :]
    key = key.contiguous()  # rotated keys are a new tensor, values stay views
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    key_cache = torch.zeros(shape, dtype=dtype, device=device)
    value_cache = torch.zeros(shape, dtype=dtype, device=device)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    write_kv(key, value, key_cache, value_cache, slot_mapping)
    write_kv_reference(key, value, expected_k, expected_v, slot_mapping)
    assert torch.equal(key_cache, expected_k), "key cache differs from the reference"
    assert torch.equal(value_cache, expected_v), "value cache differs from the reference"
    num_written = int(key_cache.count_nonzero())
    assert num_written == num_tokens * num_kv_heads * head_dim, f"{num_written} values written"


def check_write_kv_padding(device: torch.device | str = "cpu") -> None:
    """Negative slots (the padding rows of a CUDA-graph decode batch) are skipped: 4 tokens,
    2 of them padding, written as the reference writes them, exactly 2 slots touched.

    Raises:
        AssertionError: a cache differs from the reference or a padding row was written.
    """
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(4, 2, 16, generator=gen).to(device)
    value = torch.randn(4, 2, 16, generator=gen).to(device)
    slots = torch.tensor([5, -1, 33, -1], device=device)
    caches = [torch.zeros(2, 3, 16, 16, device=device) for _ in range(4)]
    write_kv(key, value, caches[0], caches[1], slots)
    write_kv_reference(key, value, caches[2], caches[3], slots)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got, want), "cache differs from the reference"
    flat = caches[0].view(2, -1, 16)
    assert torch.equal(flat[:, 5], key[0]) and torch.equal(flat[:, 33], key[2])
    num_written = int(torch.count_nonzero(flat.abs().sum(-1)))
    assert num_written == 2 * 2, f"{num_written} (slot, head) rows written, not 4"
