"""The quantized linear ops against their torch definitions: the per-token quantization and the
rescale bit-exact, the int8 GEMM exact up to its bfloat16 output, the int4 kernel the Q4_1
weight's own product."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from iterserve.kernels.layer_ops import rms_norm_cpu, silu_and_mul_cpu
from iterserve.kernels.quantized_linear import (
    Int4Linear,
    Int8Linear,
    Q4Weight,
    RowsDispatch,
    dequantize_rows,
    quantize_rows_int8,
    quantize_rows_int8_reference,
    quantize_weight_int8,
    rms_norm_quantize,
    silu_and_mul_quantize,
    smoothing_factors,
)

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def _rows(num_rows: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, k, generator=g)
    x[:, 5] *= 40  # an outlier channel, as real activations have
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("num_rows", [1, 7, 300])
@pytest.mark.parametrize("smoothed", [False, True], ids=["plain", "smoothed"])
def test_per_token_quantization_is_the_reference_exactly(num_rows: int, smoothed: bool) -> None:
    x = _rows(num_rows, 576)
    x[0] = 0  # a row of zeros: scale 0, q 0
    smooth = torch.rand(576) + 0.25 if smoothed else None
    stored, scale = quantize_rows_int8(x, smooth)
    assert stored.dtype == torch.uint8
    q = stored.to(torch.int16) - 128  # zero point 128
    ref_q, ref_scale = quantize_rows_int8_reference(x, smooth)
    assert torch.equal(q, ref_q.to(torch.int16)) and torch.equal(scale, ref_scale)
    assert scale[0] == 0 and not q[0].any()
    assert (q[1:].abs().amax(dim=1) == 127).all()  # each nonzero row uses the whole range


def test_quantization_reads_strided_rows_and_refuses_other_layouts() -> None:
    wide = _rows(4, 960)
    view = wide[:, :576]  # q of a fused qkv output: rows 960 apart
    stored, reference = quantize_rows_int8(view)[0], quantize_rows_int8_reference(view)[0]
    assert torch.equal(stored.to(torch.int16) - 128, reference.to(torch.int16))
    with pytest.raises(ValueError, match="bfloat16"):
        quantize_rows_int8(view.float())
    with pytest.raises(ValueError, match="smooth"):
        quantize_rows_int8(view, torch.ones(8))


def test_rescale_rounds_as_torch_does() -> None:
    acc = torch.randn(5, 64) * 100
    scale = torch.rand(5)
    bias = torch.randn(64).to(torch.bfloat16)
    assert torch.equal(dequantize_rows(acc, scale), (acc * scale[:, None]).to(torch.bfloat16))
    expected = (acc * scale[:, None]).to(torch.bfloat16) + bias
    assert torch.equal(dequantize_rows(acc, scale, bias), expected)


@pytest.mark.parametrize("num_rows", [1, 33])
def test_int8_linear_is_the_integer_product(num_rows: int) -> None:
    """oneDNN's int8 GEMM: the exact integer product, scaled, up to the bfloat16 output."""
    x, w = _rows(num_rows, 576, 1), _rows(960, 576, 2)
    smoothing = smoothing_factors(x.float().abs().amax(0), w)
    out = Int8Linear(w, smoothing)(x)
    q, s = quantize_rows_int8_reference(x, 1.0 / smoothing)
    wq, ws = quantize_weight_int8(w.float() * smoothing)
    exact = (q.double() @ wq.double().t()) * ws.double() * s.double()[:, None]
    assert out.dtype == torch.bfloat16 and out.shape == (num_rows, 960)
    torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=1e-3 * exact.abs().max())
    full = x.double() @ w.double().t()  # and it approximates the bfloat16 product
    assert (out.double() - full).abs().max() < 0.05 * full.abs().max()


def test_smoothing_keeps_the_product_and_tames_the_outlier_channel() -> None:
    x, w = _rows(16, 576, 3), torch.randn(64, 576).to(torch.bfloat16)
    s = smoothing_factors(x.float().abs().amax(0), w)
    torch.testing.assert_close((x.float() / s) @ (w.float() * s).t(), x.float() @ w.float().t(),
                               rtol=1e-4, atol=1e-3)  # fmt: skip
    before, after = x.float().abs().amax(0), (x.float() / s).abs().amax(0)
    assert after.max() / after.median() < (before.max() / before.median()) / 4
    dead = smoothing_factors(torch.zeros(576), w)  # channels never seen: left alone
    assert torch.equal(dead, torch.ones(576))


@pytest.mark.parametrize("num_rows", [1, 5, 200])
@pytest.mark.parametrize("smoothed", [False, True], ids=["plain", "smoothed"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["first", "residual"])
def test_the_fused_norm_quantizes_what_the_norm_writes(
    num_rows: int, smoothed: bool, with_residual: bool
) -> None:
    """rms_norm_quantize is rms_norm_cpu then quantize_rows_int8, byte for byte (its strided
    input read in place, the residual sum stored back the same)."""
    g = torch.Generator().manual_seed(num_rows)
    x = (torch.randn(num_rows, 2, 576, generator=g) * 3).to(torch.bfloat16)[:, 0]
    weight = (torch.rand(576, generator=g) + 0.5).to(torch.bfloat16)
    smooth = torch.rand(576, generator=g) + 0.5 if smoothed else None
    residual = torch.randn(num_rows, 576, generator=g).to(torch.bfloat16)
    chain_residual, fused_residual = (
        (residual.clone(), residual.clone()) if with_residual else (None, None)
    )
    q, scale = quantize_rows_int8(rms_norm_cpu(x, weight, 1e-5, chain_residual), smooth)
    fused = rms_norm_quantize(x, weight, 1e-5, fused_residual, smooth)
    assert torch.equal(fused.q, q) and torch.equal(fused.scale, scale)
    assert fused.num_rows == num_rows
    if with_residual:
        assert torch.equal(fused_residual, chain_residual)
        assert not torch.equal(fused_residual, residual)


@pytest.mark.parametrize("num_rows", [1, 5, 64])
@pytest.mark.parametrize("smoothed", [False, True], ids=["plain", "smoothed"])
def test_the_fused_swiglu_quantizes_what_the_chain_writes(num_rows: int, smoothed: bool) -> None:
    """silu_and_mul_quantize is dequantize_rows, silu_and_mul_cpu, quantize_rows_int8 in
    one pass, byte for byte (large and negative gate values included: SiLU's tails)."""
    g = torch.Generator().manual_seed(num_rows)
    acc = torch.randn(num_rows, 2 * 1536, generator=g) * 30
    acc_scale = torch.rand(num_rows, generator=g) * 0.5
    smooth = torch.rand(1536, generator=g) + 0.5 if smoothed else None
    q, scale = quantize_rows_int8(silu_and_mul_cpu(dequantize_rows(acc, acc_scale)), smooth)
    fused = silu_and_mul_quantize(acc, acc_scale, smooth)
    assert torch.equal(fused.q, q) and torch.equal(fused.scale, scale)
    strided = torch.stack([acc_scale, acc_scale], dim=1)[:, 0]  # a strided view: copied, held
    assert torch.equal(silu_and_mul_quantize(acc, strided, smooth).q, q)


def test_the_fused_kernels_refuse_what_they_cannot_read() -> None:
    x = _rows(4, 64)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_quantize(x, torch.ones(64), 1e-5)  # float32 weight
    with pytest.raises(ValueError, match="residual"):
        rms_norm_quantize(x, torch.ones(64, dtype=torch.bfloat16), 1e-5, torch.zeros(3, 64))
    with pytest.raises(ValueError, match="smooth"):
        rms_norm_quantize(x, torch.ones(64, dtype=torch.bfloat16), 1e-5, None, torch.ones(63))
    with pytest.raises(ValueError, match="acc"):
        silu_and_mul_quantize(torch.zeros(4, 7), torch.ones(4))  # odd width
    with pytest.raises(ValueError, match="acc_scale"):
        silu_and_mul_quantize(torch.zeros(4, 8), torch.ones(3))


def test_int8_linear_takes_rows_quantized_elsewhere() -> None:
    """A layer handed its input quantized (by a fused norm) computes what it computes from
    the bfloat16 rows."""
    weight = torch.randn(96, 64, generator=torch.Generator().manual_seed(3))
    smoothing = torch.rand(64) + 0.5
    layer = Int8Linear(weight, smoothing)
    x = _rows(6, 64)
    assert torch.equal(layer(layer.quantize_input(x)), layer(x))


def _q4_weight(out: int, k: int, seed: int = 0) -> Q4Weight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out, k), generator=g, dtype=torch.uint8)
    d = torch.rand(out, k // 32, generator=g) * 0.02
    m = -torch.rand(out, k // 32, generator=g) * 0.1
    return Q4Weight(q, d, m)


@pytest.mark.parametrize("num_rows", [1, 5, 64])
def test_int4_linear_multiplies_by_the_q4_1_weight(num_rows: int) -> None:
    weight = _q4_weight(960, 576)
    x = _rows(num_rows, 576, 5)
    out = Int4Linear(weight)(x)
    ref = x.double() @ weight.dequantize().to(torch.bfloat16).double().t()
    # the kernel holds scale and zero in bfloat16: a few 2^-8 of the largest output
    assert (out.double() - ref).abs().max() < 2**-6 * ref.abs().max()
    bias = torch.randn(960).to(torch.bfloat16)
    torch.testing.assert_close(Int4Linear(weight)(x, bias), out + bias)
    with pytest.raises(ValueError, match="multiple of 32"):
        Int4Linear(Q4Weight(weight.q[:, :40], weight.d[:, :1], weight.m[:, :1]))


def test_rows_dispatch_takes_each_segments_kernel() -> None:
    calls: list[str] = []

    def kernel(name: str) -> Any:
        return lambda x, bias: calls.append(name) or x

    op = RowsDispatch([(4, kernel("a")), (64, kernel("b"))], kernel("c"))
    for rows in (1, 4, 5, 64, 65, 300):
        op(torch.zeros(rows, 2), None)
    assert calls == ["a", "a", "b", "b", "c", "c"]
