"""The C layer ops against their torch references: bit-exact in bfloat16 (they round every
intermediate the references round), within float32 rounding in float32."""

from __future__ import annotations

import math

import pytest
import torch

from iterserve.kernels.layer_ops import (
    argmax_rows_cpu,
    reshape_and_cache_cpu,
    rms_norm_cpu,
    rms_norm_reference,
    rotary_embedding_cpu,
    rotary_embedding_reference,
    silu_and_mul_cpu,
    silu_and_mul_reference,
)

# The project needs a C compiler (README); the fallback without one is tested in
# test_cpu_build.py.
pytestmark = pytest.mark.usefixtures("cpu_kernels")

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
NUM_TOKENS = pytest.mark.parametrize("num_tokens", [1, 3, 64])


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    if out.dtype == torch.bfloat16:
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@DTYPES
@NUM_TOKENS
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, num_tokens: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    # x as a strided view (every other row of a wider tensor).
    x = (torch.randn(num_tokens, 2, 576, generator=gen) * 3).to(dtype)[:, 0]
    weight = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    residual = torch.randn(num_tokens, 576, generator=gen).to(dtype) if with_residual else None
    ref, ref_residual = rms_norm_reference(
        x, weight, 1e-5, residual.clone() if residual is not None else None
    )
    out = rms_norm_cpu(x, weight, 1e-5, residual)
    assert_matches(out, ref)
    if residual is not None:
        assert ref_residual is not None
        assert_matches(residual, ref_residual)


@DTYPES
@NUM_TOKENS
def test_silu_and_mul(dtype: torch.dtype, num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    # Wide range: large negative gates (exp overflow side) and large positive ones.
    gate_up = (torch.randn(num_tokens, 2 * 1536, generator=gen) * 8).to(dtype)
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0], dtype=dtype)
    assert_matches(silu_and_mul_cpu(gate_up), silu_and_mul_reference(gate_up))


@DTYPES
@NUM_TOKENS
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_embedding_in_place(dtype: torch.dtype, num_tokens: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim + num_tokens)
    num_heads, num_kv_heads, max_position = 9, 3, 4096
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.outer(torch.arange(max_position).float(), inv_freq)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    positions = torch.randint(0, max_position, (num_tokens,), generator=gen)
    ref_q = rotary_embedding_reference(q, positions, cos, sin)
    ref_k = rotary_embedding_reference(k, positions, cos, sin)
    rotary_embedding_cpu(q, k, positions, cos.to(dtype), sin.to(dtype))
    assert_matches(q, ref_q)
    assert_matches(k, ref_k)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim :], v_before)  # v untouched


@DTYPES
def test_reshape_and_cache_writes_each_slot(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    num_kv_heads, num_blocks, block_size, head_dim = 3, 6, 4, 64
    kv = torch.randn(5, 2 * num_kv_heads * head_dim, generator=gen).to(dtype)
    key = kv[:, : num_kv_heads * head_dim].view(5, num_kv_heads, head_dim)
    value = kv[:, num_kv_heads * head_dim :].view(5, num_kv_heads, head_dim)
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    key_cache, value_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    slots = torch.tensor([0, 23, 5, -1, 9])  # -1: skipped
    reshape_and_cache_cpu(key, value, key_cache, value_cache, slots)
    ref_key, ref_value = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            ref_key[:, slot // block_size, slot % block_size] = key[t]
            ref_value[:, slot // block_size, slot % block_size] = value[t]
    assert torch.equal(key_cache, ref_key)
    assert torch.equal(value_cache, ref_value)
    with pytest.raises(ValueError, match="slots must be"):
        reshape_and_cache_cpu(key, value, key_cache, value_cache, torch.tensor([0, 1, 2, 3, 24]))


def test_launchers_reject_bad_layouts() -> None:
    x = torch.randn(4, 576)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_cpu(x, torch.ones(575), 1e-5)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        rms_norm_cpu(x.half(), torch.ones(576).half(), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_cpu(x, torch.ones(576), 1e-5, torch.zeros(4, 576).t().contiguous().t())
    with pytest.raises(ValueError, match="even"):
        silu_and_mul_cpu(torch.randn(4, 7))
    with pytest.raises(ValueError, match="contiguous last dim"):
        silu_and_mul_cpu(torch.randn(8, 4).t())
    q, k = torch.randn(2, 9, 64), torch.randn(2, 3, 64)
    cos = torch.randn(16, 64)
    with pytest.raises(ValueError, match="q's dtype"):
        rotary_embedding_cpu(q, k, torch.tensor([0, 1]), cos.bfloat16(), cos.bfloat16())
    with pytest.raises(ValueError, match="positions"):
        rotary_embedding_cpu(q, k, torch.tensor([0, 1], dtype=torch.int32), cos, cos)
    with pytest.raises(ValueError, match="positions outside"):
        rotary_embedding_cpu(q, k, torch.tensor([0, 16]), cos, cos)  # cos has 16 positions
    with pytest.raises(ValueError, match="positions outside"):
        rotary_embedding_cpu(q, k, torch.tensor([-1, 3]), cos, cos)


def argmax_reference(row: list[float]) -> int:
    """Index of the first NaN, else the first index of the maximum, in plain Python."""
    nans = [i for i, v in enumerate(row) if math.isnan(v)]
    return nans[0] if nans else max(range(len(row)), key=lambda i: (row[i], -i))


@DTYPES
def test_argmax_rows_matches_torch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 2, 1000, generator=gen).to(dtype)[:, 0]  # strided rows
    x[1, 10] = x[1, 900] = 50.0  # a tie: the first index wins
    x[2, 7] = float("nan")  # NaN wins, as in torch
    x[3] = -float("inf")
    x[4, :] = 0.0
    x[5, 999] = 99.0
    expected = [argmax_reference(row) for row in x.float().tolist()]  # bfloat16 -> exact
    assert expected[1:] == [10, 7, 0, 0, 999]  # the rows built above
    out = argmax_rows_cpu(x)
    assert out.tolist() == expected
    assert x.argmax(dim=-1).tolist() == expected  # torch's rule, which the sampler replaces
    assert argmax_rows_cpu(torch.randn(1, 1).to(dtype)).tolist() == [0]
    with pytest.raises(ValueError, match="empty"):
        argmax_rows_cpu(torch.empty(2, 0, dtype=dtype))
