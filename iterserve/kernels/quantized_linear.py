"""Quantized linear layers for CPUs: int8 compute (W8A8) and a GGUF's own 4-bit weights (Q4_1).

- :class:`Int8Linear`: weights int8 per output channel and activations int8 per token,
  quantized on the fly, both symmetric (scale = max |value| / 127), as in SmoothQuant's W8A8
  scheme (Xiao et al., 2023) without its smoothing, and LLM.int8()'s vector-wise scales
  (Dettmers et al., 2022) without its outliers. The int8 x int8 GEMM with int32 accumulation
  is oneDNN's (``torch.ops.onednn.qlinear_pointwise`` on a weight prepacked once: AVX-512
  VNNI, or AMX-INT8 where the CPU has it); the per-token steps around it are one C pass each
  (``csrc/quant_ops.c``).
- :class:`Int4Linear`: a GGUF's Q4_1 blocks (32 weights ``w = d * q + m``, ``q`` in 0..15) by
  PyTorch's CPU int4 weight-only kernel (``_weight_int4pack_mm_for_cpu``: groups of 32 with a
  scale and a zero, ``w = (q - 8) * scale + zero``; so ``scale = d``, ``zero = m + 8 d``),
  bfloat16 activations. Nothing is de-quantized.
- :class:`RowsDispatch`: two of these ops, chosen per call by the number of rows (the
  iteration's tokens), at a crossover the executor measures at start
  (:mod:`iterserve.executor.quantization`).

Each op is a :data:`~iterserve.kernels.platform.LinearOp`: ``op(x, bias)`` with x
``[num_tokens, in_features]`` bfloat16 -> ``[num_tokens, out_features]`` bfloat16.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from iterserve.kernels.cpu_build import load_cpu_kernels
from iterserve.kernels.platform import LinearOp

Q4_GROUP = 32  # weights per Q4_1 block (ggml's QK4_1), the int4 kernel's group size
Q4_1_BLOCK_BYTES = 20  # float16 d, float16 m, 16 bytes of two 4-bit values each
ACTIVATION_ZERO_POINT = 128  # activations go to the int8 GEMM as uint8 q + 128

_P, _I, _N, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES: dict[str, tuple[list[type], type | None]] = {
    # q, scale, x, x_stride, smooth, num_rows, k, num_threads
    "quantize_rows_int8_bf16": ([_P, _P, _P, _I, _P, _I, _I, _N], None),
    # out, acc, scale, bias, num_rows, n, num_threads
    "dequantize_rows_bf16": ([_P, _P, _P, _P, _I, _I, _N], None),
    # q, scale, x, x_stride, residual, weight, smooth, num_rows, k, eps, num_threads -> 0 / -1
    "rms_norm_quantize_bf16": ([_P, _P, _P, _I, _P, _P, _P, _I, _I, _F, _N], _N),
    # q, scale, acc, acc_scale, smooth, num_rows, inter, num_threads -> 0 / -1
    "silu_and_mul_quantize_bf16": ([_P, _P, _P, _P, _P, _I, _I, _N], _N),
}


def int8_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :class:`Int8Linear` runs here: CPU, bfloat16 activations, torch's oneDNN int8
    linear, and the C kernels built (see :func:`~iterserve.kernels.cpu_build.load_cpu_kernels`)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.onednn, "qlinear_prepack")
        and load_cpu_kernels() is not None
    )


def int4_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :class:`Int4Linear` runs here: CPU, bfloat16 activations, torch's CPU int4 kernel."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    )


@functools.cache
def _fn(name: str) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    lib = load_cpu_kernels()
    if lib is None:
        raise RuntimeError("the CPU kernels could not be built on this machine (no C compiler?)")
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = _SIGNATURES[name]
    return fn


@dataclass(frozen=True)
class QuantizedRows:
    """Activations quantized per row for :class:`Int8Linear` (:func:`quantize_rows_int8`'s
    output, or a fused kernel's: :func:`rms_norm_quantize`, :func:`silu_and_mul_quantize`).

    Attributes:
        q: [num_rows, k] uint8, each value q + :data:`ACTIVATION_ZERO_POINT`.
        scale: [num_rows] float32, each row's scale (``x ~ (q - 128) * scale``).
    """

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.q.shape[0]


def _check_smooth(smooth: torch.Tensor | None, k: int) -> None:
    if smooth is not None and (
        smooth.shape != (k,) or smooth.dtype != torch.float32 or not smooth.is_contiguous()
    ):
        raise ValueError(f"smooth must be contiguous float32 [{k}]")


def _quantized_rows(num_rows: int, k: int) -> QuantizedRows:
    return QuantizedRows(
        torch.empty(num_rows, k, dtype=torch.uint8), torch.empty(num_rows, dtype=torch.float32)
    )


def _check_status(status: int, name: str) -> None:
    if status != 0:
        raise MemoryError(f"{name}: a thread's row scratch could not be allocated")


def quantize_rows_int8_reference(
    x: torch.Tensor, smooth: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 quantization, the torch definition of
    :func:`quantize_rows_int8`: ``x' = x * smooth`` (when given), ``scale = max|x'| / 127``,
    ``q = round(x' * (127 / max|x'|))`` (half to even) clamped to [-127, 127]; a row of zeros
    gets scale 0 and q 0. (:func:`quantize_rows_int8` stores ``q + 128`` as uint8.)

    Args:
        x: [num_rows, k], any float dtype.
        smooth: [k] float32, a factor per column (SmoothQuant's 1 / s), or None.

    Returns:
        ``(q [num_rows, k] int8, scale [num_rows] float32)``.
    """
    xf = x.float() if smooth is None else x.float() * smooth
    amax = xf.abs().amax(dim=1)
    full127 = torch.full_like(amax, 127.0)  # true divisions (a scalar divides as a reciprocal)
    inv = torch.where(amax > 0, full127 / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, amax / full127


def quantize_rows_int8(
    x: torch.Tensor, smooth: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows_int8_reference` in one C pass, stored with zero point
    :data:`ACTIVATION_ZERO_POINT`: oneDNN's int8 GEMMs on VNNI multiply unsigned activations by
    signed weights (``vpdpbusd``); signed activations take a reference path hundreds of times
    slower on CPUs without AMX.

    Args:
        x: [num_rows, k] bfloat16 CPU tensor, last dim contiguous (rows may be strided).
        smooth: [k] float32 contiguous, or None.

    Returns:
        ``(q + 128 [num_rows, k] uint8, scale [num_rows] float32)``, both contiguous.

    Raises:
        ValueError: another dtype, device or layout.
    """
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("x must be a 2-d bfloat16 CPU tensor with a contiguous last dim")
    num_rows, k = x.shape
    _check_smooth(smooth, k)
    out = _quantized_rows(num_rows, k)
    _fn("quantize_rows_int8_bf16")(
        out.q.data_ptr(), out.scale.data_ptr(), x.data_ptr(), x.stride(0),
        smooth.data_ptr() if smooth is not None else None, num_rows, k, torch.get_num_threads(),
    )  # fmt: skip
    return out.q, out.scale


def rms_norm_quantize(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    smooth: torch.Tensor | None = None,
) -> QuantizedRows:
    """``quantize_rows_int8(rms_norm_cpu(x, weight, eps, residual), smooth)`` in one pass, the
    same bytes: the normalised row is quantized where it is computed, never stored as bfloat16.

    Args:
        x: [num_rows, k] bfloat16 CPU, last dim contiguous (rows may be strided).
        weight: [k] bfloat16 contiguous, the norm's weight.
        eps: the norm's epsilon.
        residual: [num_rows, k] bfloat16 contiguous or None; when given, ``x + residual`` is
            normalised and stored back into it (as :func:`~iterserve.kernels.layer_ops.
            rms_norm_cpu` does).
        smooth: [k] float32 contiguous (SmoothQuant's 1 / s of the next layer), or None.

    Returns:
        :class:`QuantizedRows` of the normalised rows.

    Raises:
        ValueError: another dtype, device, shape or layout.
        MemoryError: a thread's scratch row could not be allocated.
    """
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("x must be a 2-d bfloat16 CPU tensor with a contiguous last dim")
    num_rows, k = x.shape
    if weight.shape != (k,) or weight.dtype != torch.bfloat16 or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous bfloat16 [{k}]")
    if residual is not None and (
        residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous()
    ):
        raise ValueError("residual must be contiguous with x's shape and dtype")
    _check_smooth(smooth, k)
    out = _quantized_rows(num_rows, k)
    status = _fn("rms_norm_quantize_bf16")(
        out.q.data_ptr(), out.scale.data_ptr(), x.data_ptr(), x.stride(0),
        residual.data_ptr() if residual is not None else None, weight.data_ptr(),
        smooth.data_ptr() if smooth is not None else None, num_rows, k, eps,
        torch.get_num_threads(),
    )  # fmt: skip
    _check_status(status, "rms_norm_quantize")
    return out


def silu_and_mul_quantize(
    acc: torch.Tensor, acc_scale: torch.Tensor, smooth: torch.Tensor | None = None
) -> QuantizedRows:
    """A gate_up projection's int8 GEMM output through SwiGLU into the down projection's
    input: ``quantize_rows_int8(silu_and_mul_cpu(dequantize_rows(acc, acc_scale)), smooth)``
    in one pass, the same bytes.

    Args:
        acc: [num_rows, 2 * inter] float32 contiguous (:meth:`Int8Linear.accumulate`: gate
            columns first, weight scales applied).
        acc_scale: [num_rows] float32 contiguous, each row's activation scale.
        smooth: [inter] float32 contiguous (the down projection's 1 / s), or None.

    Returns:
        :class:`QuantizedRows` ``[num_rows, inter]``.

    Raises:
        ValueError: another dtype, shape or layout.
        MemoryError: a thread's scratch row could not be allocated.
    """
    if acc.dtype != torch.float32 or acc.dim() != 2 or not acc.is_contiguous() or acc.shape[1] % 2:
        raise ValueError("acc must be contiguous float32 [num_rows, 2 * inter]")
    num_rows, inter = acc.shape[0], acc.shape[1] // 2
    if acc_scale.shape != (num_rows,) or acc_scale.dtype != torch.float32:
        raise ValueError(f"acc_scale must be float32 [{num_rows}]")
    acc_scale = acc_scale.contiguous()  # held here: the C call reads it
    _check_smooth(smooth, inter)
    out = _quantized_rows(num_rows, inter)
    status = _fn("silu_and_mul_quantize_bf16")(
        out.q.data_ptr(), out.scale.data_ptr(), acc.data_ptr(), acc_scale.data_ptr(),
        smooth.data_ptr() if smooth is not None else None, num_rows, inter,
        torch.get_num_threads(),
    )  # fmt: skip
    _check_status(status, "silu_and_mul_quantize")
    return out


def dequantize_rows(
    acc: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``(acc * scale[:, None]).bfloat16() (+ bias)`` in one C pass (the sum rounded as torch's
    bfloat16 add rounds it).

    Args:
        acc: [num_rows, n] float32 contiguous: the GEMM's output, weight scales applied.
        scale: [num_rows] float32 contiguous, each row's activation scale.
        bias: [n] bfloat16 contiguous, or None.

    Returns:
        [num_rows, n] bfloat16.
    """
    num_rows, n = acc.shape
    if acc.dtype != torch.float32 or not acc.is_contiguous() or scale.shape != (num_rows,):
        raise ValueError("acc must be contiguous float32 [num_rows, n], scale [num_rows]")
    if bias is not None and (bias.shape != (n,) or bias.dtype != torch.bfloat16):
        raise ValueError(f"bias must be bfloat16 [{n}]")
    out = torch.empty(num_rows, n, dtype=torch.bfloat16)
    _fn("dequantize_rows_bf16")(
        out.data_ptr(), acc.data_ptr(), scale.data_ptr(),
        bias.contiguous().data_ptr() if bias is not None else None, num_rows, n,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 weights: ``weight [out, in]`` -> ``(q [out, in] int8,
    scale [out] float32)``, ``weight ~ q * scale[:, None]`` (a row of zeros: scale 1)."""
    q, scale = quantize_rows_int8_reference(weight)
    return q, torch.where(scale > 0, scale, torch.ones_like(scale))


def smoothing_factors(
    input_absmax: torch.Tensor, weight: torch.Tensor, alpha: float = 0.5
) -> torch.Tensor:
    """SmoothQuant's per-input-channel ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)`` (Xiao et
    al., 2023, eq. 4): dividing the activations' column j by s_j and multiplying the weight's
    column j by it leaves ``x W^T`` unchanged and moves the activations' outlier channels'
    range into the weight, where a per-channel scale absorbs it.

    Args:
        input_absmax: [in_features] float32, max |x_j| over calibration tokens.
        weight: [out_features, in_features].
        alpha: the migration strength (0.5 in the paper for most models).

    Returns:
        [in_features] float32, positive (channels never seen or all-zero: 1).
    """
    w_absmax = weight.detach().float().abs().amax(dim=0)
    s = input_absmax.float().pow(alpha) / w_absmax.pow(1 - alpha)
    ok = (input_absmax > 0) & (w_absmax > 0) & torch.isfinite(s) & (s > 0)
    return torch.where(ok, s, torch.ones_like(s))


class Int8Linear:
    """``x W^T (+ b)`` as an int8 GEMM: W int8 per output channel, x int8 per token.

    Args:
        weight: [out_features, in_features], any float dtype, CPU; quantized here (the layer
            keeps only the int8 copy, prepacked for oneDNN).
        smoothing: [in_features] float32 SmoothQuant factors (:func:`smoothing_factors`):
            the weight's columns are multiplied by them before quantizing, each activation
            column divided by its factor in the quantization pass; None: no smoothing.
    """

    def __init__(self, weight: torch.Tensor, smoothing: torch.Tensor | None = None) -> None:
        weight = weight.detach()
        self.smooth: torch.Tensor | None = None
        if smoothing is not None:
            weight = weight.float() * smoothing[None, :]
            self.smooth = (1.0 / smoothing.float()).contiguous()
        q, self.weight_scale = quantize_weight_int8(weight)
        self.out_features, self.in_features = q.shape
        self.packed = torch.ops.onednn.qlinear_prepack(q, None)
        self.weight_zero = torch.zeros(self.out_features, dtype=torch.int64)

    def quantize_input(self, x: torch.Tensor) -> QuantizedRows:
        """x [num_tokens, in_features] bfloat16 as this layer's GEMM takes it (smoothed)."""
        return QuantizedRows(*quantize_rows_int8(x, self.smooth))

    def accumulate(self, x: torch.Tensor | QuantizedRows) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 GEMM: ``(acc [num_tokens, out_features] float32, weight scales applied;
        the rows' activation scales [num_tokens] float32)``: ``x W^T = acc * scale[:, None]``."""
        rows = x if isinstance(x, QuantizedRows) else self.quantize_input(x)
        acc = torch.ops.onednn.qlinear_pointwise(
            rows.q, 1.0, ACTIVATION_ZERO_POINT, self.packed, self.weight_scale, self.weight_zero,
            None, 1.0, 0, torch.float32, "none", [], "",
        )  # fmt: skip
        return acc, rows.scale

    def __call__(
        self, x: torch.Tensor | QuantizedRows, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [num_tokens, in_features] bfloat16, or quantized already (:class:`QuantizedRows`
        with this layer's smoothing) -> [num_tokens, out_features] bfloat16."""
        return dequantize_rows(*self.accumulate(x), bias)


@dataclass(frozen=True)
class Q4Weight:
    """A weight matrix as Q4_1 blocks of :data:`Q4_GROUP` along its input features.

    Attributes:
        q: [out_features, in_features] uint8, each value in 0..15.
        d: [out_features, in_features / 32] float32, each block's scale.
        m: [out_features, in_features / 32] float32, each block's minimum.
    """

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1]

    def dequantize(self) -> torch.Tensor:
        """[out_features, in_features] float32: ``d * q + m`` per block (ggml's definition)."""
        out, k = self.shape
        blocks = self.q.view(out, k // Q4_GROUP, Q4_GROUP).float()
        return (blocks * self.d[..., None] + self.m[..., None]).view(out, k)

    @staticmethod
    def concat(parts: list[Q4Weight]) -> Q4Weight:
        """The rows of ``parts`` stacked (fused projections: q, k, v or gate, up)."""
        return Q4Weight(
            torch.cat([p.q for p in parts]),
            torch.cat([p.d for p in parts]),
            torch.cat([p.m for p in parts]),
        )


class Int4Linear:
    """``x W^T (+ b)`` with W held as Q4_1 blocks, by PyTorch's CPU int4 weight-only kernel.

    Args:
        weight: the Q4_1 weight; ``in_features`` a multiple of 32.
    """

    def __init__(self, weight: Q4Weight) -> None:
        self.out_features, self.in_features = weight.shape
        if self.in_features % Q4_GROUP:
            raise ValueError(f"in_features {self.in_features} is no multiple of {Q4_GROUP}")
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            weight.q.to(torch.int32), 1
        )
        zero = weight.m + 8 * weight.d  # w = d q + m = d (q - 8) + (m + 8 d)
        # [in_features / 32, out_features, 2]: (scale, zero) per group and output feature
        self.scales_zeros = torch.stack([weight.d, zero], dim=-1).transpose(0, 1).contiguous()
        self.scales_zeros = self.scales_zeros.to(torch.bfloat16)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [num_tokens, in_features] bfloat16 -> [num_tokens, out_features] bfloat16."""
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.contiguous(), self.packed, Q4_GROUP, self.scales_zeros
        )
        return y if bias is None else y + bias


class RowsDispatch:
    """One layer's kernels chosen per call by the rows of ``x`` (the iteration's tokens):
    the op of the first segment whose ``max_rows`` covers them, ``above`` past the last one;
    the segments measured at start (:func:`iterserve.executor.quantization.measure_kernels`).

    Args:
        segments: ``(max_rows, op)`` with ``max_rows`` ascending.
        above: the op for more rows than the last segment's.
    """

    def __init__(self, segments: Sequence[tuple[int, LinearOp]], above: LinearOp) -> None:
        self.segments = list(segments)
        self.above = above

    def op_for(self, rows: int) -> LinearOp:
        for max_rows, op in self.segments:
            if rows <= max_rows:
                return op
        return self.above

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.op_for(x.shape[0])(x, bias)


def int8_linear_for(op: LinearOp | None, rows: int) -> Int8Linear | None:
    """The :class:`Int8Linear` that ``op`` (a layer's packed op) runs for ``rows`` rows, or None
    (another kernel, or none): where it is one, the op before may hand it :class:`QuantizedRows`."""
    if isinstance(op, RowsDispatch):
        op = op.op_for(rows)
    return op if isinstance(op, Int8Linear) else None
