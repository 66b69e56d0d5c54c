"""The int8 KV cache (``--kv-cache-dtype int8``): the row format, the C write and decode kernels
against their torch references, and plain torch's ops on the same caches."""

from __future__ import annotations

import pytest
import torch
from paged_cases import random_decode_case

from iterserve.kernels.grouped_decode_attention import (
    grouped_decode_attention,
    plan_decode_groups,
)
from iterserve.kernels.kv_quant import (
    SCALE_BYTES,
    dequantize_kv_rows,
    quantize_kv_rows,
    row_width,
)
from iterserve.kernels.layer_ops import dequantize_kv_rows_cpu, reshape_and_cache_cpu
from iterserve.kernels.paged_decode_attention import (
    paged_decode_attention_cpu,
    paged_decode_attention_reference,
)
from iterserve.kernels.platform import TorchPlatform

pytestmark = pytest.mark.usefixtures("cpu_kernels")

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])


def test_rows_hold_int8_values_then_their_float32_scale() -> None:
    x = torch.tensor([[0.5, -1.27, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    rows = quantize_kv_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (2, 4 + SCALE_BYTES)
    scale = rows[:, 4:].contiguous().view(torch.float32)
    assert scale[0].item() == pytest.approx(1.27 / 127) and scale[1].item() == 0.0
    assert rows[0, :4].tolist() == [50, -127, 0, 100]
    assert rows[1, :4].tolist() == [0, 0, 0, 0]  # a zero row: scale 0, no division by it
    assert torch.equal(dequantize_kv_rows(rows, torch.float32)[1], x[1])
    assert row_width(64, torch.int8) == 68 and row_width(64, torch.bfloat16) == 64


def test_round_trip_error_is_at_most_half_a_step_per_row() -> None:
    gen = torch.Generator().manual_seed(0)
    # Rows of very different ranges: each gets its own scale.
    x = torch.randn(64, 3, 64, generator=gen) * torch.logspace(-3, 3, 64)[:, None, None]
    back = dequantize_kv_rows(quantize_kv_rows(x), torch.float32)
    step = x.abs().amax(dim=-1, keepdim=True) / 127
    assert ((back - x).abs() <= step / 2 * (1 + 1e-5)).all()


def _kv_case(
    gen: torch.Generator, dtype: torch.dtype, num_tokens: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """key and value as strided views into one fused output, as the model passes them."""
    kv = (torch.randn(num_tokens, 2 * num_kv_heads * head_dim, generator=gen) * 3).to(dtype)
    key = kv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = kv[:, num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    key[1] = 0.0  # a zero row
    value[1, 0, 3] = float("nan")  # a NaN: the row's scale is NaN
    value[1, 1, 5] = float("inf")  # an inf: the others read back 0 (inf * 0), it NaN
    value[1, 2] = 1e-40  # denormals: 127 / max overflows to inf
    return key, value


@DTYPES
@pytest.mark.parametrize("head_dim", [64, 80])
def test_the_c_write_quantizes_exactly_as_the_reference(dtype: torch.dtype, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    num_kv_heads, num_blocks, block_size = 3, 6, 4
    key, value = _kv_case(gen, dtype, 5, num_kv_heads, head_dim)
    shape = (num_kv_heads, num_blocks, block_size, head_dim + SCALE_BYTES)
    key_cache = torch.zeros(shape, dtype=torch.int8)
    value_cache = torch.zeros(shape, dtype=torch.int8)
    slots = torch.tensor([0, 23, 5, -1, 9])  # -1: skipped
    reshape_and_cache_cpu(key, value, key_cache, value_cache, slots)
    ref_key, ref_value = torch.zeros_like(key_cache), torch.zeros_like(value_cache)
    TorchPlatform().write_kv(key[[0, 1, 2, 4]], value[[0, 1, 2, 4]], ref_key, ref_value,
                             torch.tensor([0, 23, 5, 9]))  # fmt: skip
    assert torch.equal(key_cache, ref_key) and torch.equal(value_cache, ref_value)
    slot = 23  # token 1, the zero key row
    assert not key_cache[:, slot // block_size, slot % block_size].any()
    with pytest.raises(ValueError, match="slots must be"):
        reshape_and_cache_cpu(key, value, key_cache, value_cache, torch.tensor([0, 1, 2, 3, 24]))
    plain = torch.zeros((*shape[:3], head_dim), dtype=dtype)
    with pytest.raises(ValueError, match="both int8"):
        reshape_and_cache_cpu(key, value, plain, value_cache[..., :head_dim].contiguous(), slots)
    with pytest.raises(ValueError, match="does not fit"):
        reshape_and_cache_cpu(key, value, key_cache[..., :head_dim], value_cache, slots)


@DTYPES
def test_the_c_dequantize_equals_the_reference(dtype: torch.dtype) -> None:
    """What a prefill chunk over cached context reads (``Platform.dequantize_kv``)."""
    gen = torch.Generator().manual_seed(1)
    rows = quantize_kv_rows(torch.randn(3, 100, 64, generator=gen) * 5)
    out = dequantize_kv_rows_cpu(rows, dtype)
    assert out.dtype == dtype and torch.equal(out, dequantize_kv_rows(rows, dtype))
    with pytest.raises(ValueError, match="contiguous int8"):
        dequantize_kv_rows_cpu(rows[:, ::2], dtype)


@DTYPES
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    # SmolLM2-135M, head_dim 128, group 8 (the AVX-512 path's largest), group 9 and head_dim
    # 80 (the portable path).
    [(9, 3, 64), (8, 2, 128), (16, 2, 64), (9, 1, 64), (4, 2, 80)],
)
@pytest.mark.parametrize("block_size", [1, 12, 16])  # 12: not a power of two (portable C)
def test_the_c_decode_kernel_on_int8_caches_matches_the_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    gen = torch.Generator().manual_seed(num_heads * 100 + head_dim + block_size)
    seq_lens = [1, 2, block_size + 1, 37, 300, 5]
    q, kc, vc, bt, lens = random_decode_case(
        gen, dtype, seq_lens, num_heads, num_kv_heads, head_dim, block_size, torch.int8, spread=10.0
    )
    scale = head_dim**-0.5
    ref = paged_decode_attention_reference(q, kc, vc, bt, lens, scale)
    out = paged_decode_attention_cpu(torch.empty_like(q), q, kc, vc, bt, lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    # Plain torch's grouped decode attention reads the same caches (its probabilities rounded
    # to q's dtype before p . v).
    groups = plan_decode_groups(bt, lens, seq_lens, block_size)
    torch_out = grouped_decode_attention(q.contiguous(), groups, kc, vc, scale)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(torch_out.float(), ref.float(), atol=tol, rtol=tol)


def test_int8_attention_stays_close_to_attention_over_the_unquantized_rows() -> None:
    """The quantization's own error: the int8 kernel's output against bfloat16 attention over
    the rows before quantization (what --kv-cache-dtype auto computes)."""
    gen = torch.Generator().manual_seed(5)
    shape = (3, 80, 16, 64)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    q = torch.randn(4, 9, 64, generator=gen).bfloat16()
    bt = torch.randperm(80, generator=gen)[:76].view(4, 19).contiguous()
    lens = torch.tensor([300, 17, 150, 1])
    exact = paged_decode_attention_reference(q, k.bfloat16(), v.bfloat16(), bt, lens, 0.125)
    kq, vq = quantize_kv_rows(k), quantize_kv_rows(v)
    out = paged_decode_attention_cpu(torch.empty_like(q), q, kq, vq, bt, lens, 0.125)
    assert (out.float() - exact.float()).abs().max() < 0.03


def test_the_launcher_rejects_int8_caches_it_cannot_read() -> None:
    gen = torch.Generator().manual_seed(0)
    q, kc, vc, bt, lens = random_decode_case(gen, torch.float32, [5, 9], 9, 3, 64, 16, torch.int8)
    out = torch.empty(q.shape)
    with pytest.raises(ValueError, match="cache shapes"):
        paged_decode_attention_cpu(out, q, kc[..., :64], vc[..., :64], bt, lens, 1.0)
    with pytest.raises(ValueError, match="CPU tensors"):
        paged_decode_attention_cpu(out, q, kc, vc.float(), bt, lens, 1.0)
    with pytest.raises(ValueError, match="float32 or bfloat16 q"):
        paged_decode_attention_cpu(out.half(), q.half(), kc, vc, bt, lens, 1.0)
