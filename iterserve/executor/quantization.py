"""``--quantization``: the model's linear layers on int8 or 4-bit kernels where they pay.

- ``int8``: every decoder linear layer as :class:`~iterserve.kernels.quantized_linear.
  Int8Linear` (W8A8, smoothed as SmoothQuant does from one calibration forward); bfloat16
  kept for the batch sizes where it measured faster here.
- ``q4``: the decoder's linear layers on the GGUF's own Q4_1 weights
  (:class:`~iterserve.kernels.quantized_linear.Int4Linear`) for the batch sizes where the
  int4 kernel measured faster than bfloat16, bfloat16 (de-quantized from the same blocks)
  above.

The LM head stays bfloat16 in both (the default model's is its Q8_0 embeddings, tied).

Which kernel runs is chosen per call by the number of rows (the iteration's tokens: a decode
of a few requests is a handful, a prefill chunk hundreds), at a crossover measured at start
on this CPU (:func:`measure_crossover`), not assumed: the int4 kernel reads a quarter of the
bytes but computes slowly, so it wins small decode batches only; oneDNN's int8 GEMM wins big
batches on a CPU with VNNI or AMX-INT8 and may lose a single row to bfloat16.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from iterserve import envs
from iterserve.config import ConfigError
from iterserve.kernels.platform import LinearOp, Platform
from iterserve.kernels.quantized_linear import (
    Int4Linear,
    Int8Linear,
    RowsDispatch,
    int4_linear_available,
    int8_linear_available,
    smoothing_factors,
)
from iterserve.models.gguf_q4 import NotQ4Error, read_q4_linears
from iterserve.models.llama import LlamaForCausalLM
from iterserve.models.loader import source_gguf

logger = logging.getLogger(__name__)

# Row counts (tokens of an iteration) at which the two kernels are timed, ascending.
MEASURED_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MEASURE_REPEATS = 3
# SmoothQuant's migration strength and the calibration forward's length (docs/engine.md).
SMOOTHING_ALPHA = 0.5
CALIBRATION_TOKENS = 512


@dataclass(frozen=True)
class QuantizationPlan:
    """What ``--quantization`` chose on this machine.

    Attributes:
        mode: ``int8`` or ``q4``.
        small, large: the kernels (``bf16``, ``int8``, ``q4``) run up to ``max_small_rows``
            rows and above.
        max_small_rows: 0 when ``large`` runs every batch.
        timings_ms: rows -> (small, large) milliseconds for all the model's linears, as
            measured (the row counts measured until ``small`` lost twice).
    """

    mode: str
    small: str
    large: str
    max_small_rows: int
    timings_ms: dict[int, tuple[float, float]] = field(default_factory=dict)

    def describe(self) -> str:
        if self.max_small_rows == 0:
            choice = f"{self.large} at every batch size"
        else:
            choice = f"{self.small} up to {self.max_small_rows} tokens, {self.large} above"
        if not self.timings_ms:
            return f"{self.mode}: {choice} (ITERSERVE_QUANTIZATION_SMALL_ROWS)"
        measured = ", ".join(
            f"{rows}: {small:.1f}/{large:.1f}" for rows, (small, large) in self.timings_ms.items()
        )
        return f"{self.mode}: {choice} (ms for all linears, {self.small}/{self.large}: {measured})"


def check_quantization(
    mode: str, device: torch.device, dtype: torch.dtype, tp_size: int, model: str
) -> Path | None:
    """Refuse a ``--quantization`` this replica cannot serve, before loading anything.

    Returns:
        The GGUF file for ``q4``; None otherwise.

    Raises:
        ConfigError: CUDA (the GPU path's quantized kernels are not built yet), a dtype other
            than bfloat16, kernels this torch lacks, or for ``q4``: more than one
            tensor-parallel rank, or a model that is no GGUF file.
    """
    if mode == "none":
        return None
    if device.type != "cpu":
        raise ConfigError(
            f"--quantization {mode} runs on CPUs only today: on {device.type} serve with "
            "--quantization none (the GPU path's int8 and 4-bit kernels are not built yet)"
        )
    if dtype != torch.bfloat16:
        raise ConfigError(f"--quantization {mode} computes in bfloat16: use --dtype auto")
    if mode == "int8" and not int8_linear_available(device, dtype):
        raise ConfigError(
            "--quantization int8 needs torch's oneDNN int8 linear "
            "(torch.ops.onednn.qlinear_pointwise) and a C compiler for its per-token kernels"
        )
    if mode != "q4":
        return None
    if not int4_linear_available(device, dtype):
        raise ConfigError("--quantization q4 needs torch's CPU int4 kernel (_weight_int4pack_mm)")
    if tp_size > 1:
        raise ConfigError(
            "--quantization q4 serves one shard (tensor_parallel_size 1); int8 shards"
        )
    gguf = source_gguf(model)
    if gguf is None:
        raise ConfigError(
            f"--quantization q4 serves a GGUF file's own Q4_1 weights; {model!r} is no .gguf "
            "file (use --quantization int8, or give the .gguf)"
        )
    return gguf


def _bf16_op(platform: Platform, weight: torch.Tensor) -> LinearOp:
    packed = platform.pack_linear_weight(weight)
    if packed is not None:
        return packed
    plain = weight.detach()
    return lambda x, bias: F.linear(x, plain, bias)


def _time_all(ops: Sequence[LinearOp], inputs: Sequence[torch.Tensor]) -> float:
    """Median seconds of one pass over every op in turn (a pass before, not timed)."""
    times = []
    for i in range(MEASURE_REPEATS + 1):
        start = time.perf_counter()
        for op, x in zip(ops, inputs, strict=True):
            op(x, None)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_crossover(
    small: Sequence[LinearOp], large: Sequence[LinearOp], in_features: Sequence[int]
) -> tuple[int, dict[int, tuple[float, float]]]:
    """The most rows up to which the ``small`` kernels beat the ``large`` ones, timed here.

    At each of :data:`MEASURED_ROWS`, ascending, a pass over all the model's layers with
    each kernel (every weight read from memory, as in a forward, not from a warm cache);
    ``small`` is kept up to the last row count of its first run of wins, and the measuring
    stops after two losses.

    Args:
        small, large: one op per layer, the same layers in the same order.
        in_features: each layer's input width.

    Returns:
        ``(max_small_rows, timings)``: 0 when ``small`` lost at one row; timings rows ->
        (small ms, large ms).
    """
    max_small, losses = 0, 0
    timings: dict[int, tuple[float, float]] = {}
    with torch.inference_mode():
        for rows in MEASURED_ROWS:
            widths = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in set(in_features)}
            inputs = [widths[k] for k in in_features]
            t_small, t_large = _time_all(small, inputs), _time_all(large, inputs)
            timings[rows] = (t_small * 1e3, t_large * 1e3)
            if t_small <= t_large and losses == 0:
                max_small = rows
            else:
                losses += 1
                if losses == 2:
                    break
    return max_small, timings


def calibration_token_ids(model_dir: Path, count: int = CALIBRATION_TOKENS) -> list[int]:
    """The first ``count`` tokens of the calibration text: Python's own docstrings
    (:func:`~iterserve.workload.workloads.corpus_text`: English and code), not the text the
    perplexity is measured on."""
    from transformers import AutoTokenizer

    from iterserve.workload.workloads import corpus_text

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return list(tokenizer.encode(corpus_text()[: count * 8]))[:count]


def _causal_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
    """Dense causal attention of one sequence (calibration runs without the paged KV cache)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return out.transpose(0, 1)


@torch.inference_mode()
def input_absmax(model: LlamaForCausalLM, token_ids: list[int]) -> dict[str, torch.Tensor]:
    """Per linear layer, ``max |x_j|`` of its input columns over one forward of ``token_ids``
    (one sequence) through the bfloat16 model: SmoothQuant's calibration statistic."""
    stats: dict[str, torch.Tensor] = {}

    def record(name: str) -> Any:
        def hook(module: Any, args: tuple[torch.Tensor, ...]) -> None:
            seen = args[0].detach().float().abs().amax(dim=0)
            stats[name] = torch.maximum(stats[name], seen) if name in stats else seen

        return hook

    handles = [m.register_forward_pre_hook(record(n)) for n, m in model.linear_layers()]
    try:
        ids = torch.tensor(token_ids, dtype=torch.int64)
        model(ids, torch.arange(len(token_ids)), _causal_attention)
    finally:
        for handle in handles:
            handle.remove()
    return stats


def quantize_linears(
    model: LlamaForCausalLM, mode: str, model_dir: Path, gguf: Path | None, hf_config: Any
) -> QuantizationPlan:
    """Put the loaded (bfloat16) model's decoder linear layers on ``mode``'s kernels, each
    layer choosing by rows at the crossover measured here; the plain weights are freed. The
    LM head stays bfloat16 (its int8 copy cost more agreement than every other layer's
    together for a few percent of the time, docs/engine.md). Instead of
    :meth:`~iterserve.models.llama.LlamaForCausalLM.pack_linear_weights`, once after loading.

    ``int8`` smooths each layer's activations first (:func:`~iterserve.kernels.
    quantized_linear.smoothing_factors`, alpha :data:`SMOOTHING_ALPHA`) from one calibration
    forward (:func:`input_absmax` over :func:`calibration_token_ids`).

    Raises:
        ConfigError: ``q4`` on a file whose linear weights are not all Q4_1.
    """
    layers = model.linear_layers()
    platform = model.platform
    bf16 = [_bf16_op(platform, module.weight) for _, module in layers]
    in_features = [module.weight.shape[1] for _, module in layers]
    if mode == "int8":
        absmax = input_absmax(model, calibration_token_ids(model_dir))
        small_kind, large_kind, small = "bf16", "int8", bf16
        large: list[LinearOp] = [
            Int8Linear(m.weight, smoothing_factors(absmax[name], m.weight, SMOOTHING_ALPHA))
            for name, m in layers
        ]
    else:
        assert gguf is not None, "check_quantization gives q4 its file"
        try:
            q4 = read_q4_linears(gguf, hf_config)
        except NotQ4Error as e:
            raise ConfigError(f"--quantization q4: {e}") from e
        small_kind, large_kind, large = "q4", "bf16", bf16
        small = [Int4Linear(q4[name]) for name, _ in layers]
    try:
        fixed = envs.quantization_small_rows()
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if fixed is None:
        max_small, timings = measure_crossover(small, large, in_features)
    else:
        max_small, timings = fixed, {}
    ops = [
        lg if max_small == 0 else RowsDispatch(s, lg, max_small)
        for s, lg in zip(small, large, strict=True)
    ]
    model.install_linear_ops(
        dict(zip((name for name, _ in layers), ops, strict=True)),
        _bf16_op(platform, model.lm_head_weight),
    )
    plan = QuantizationPlan(mode, small_kind, large_kind, max_small, timings)
    logger.info("quantization %s", plan.describe())
    return plan
