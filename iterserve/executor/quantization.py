"""``--quantization``: the model's linear layers on int8 or 4-bit kernels where they pay.

- ``int8``: the decoder's linear layers and the LM head as :class:`~iterserve.kernels.
  quantized_linear.Int8Linear` (W8A8, smoothed as SmoothQuant does from one calibration
  forward), bfloat16 kept for the batch sizes where it measured faster here.
- ``q4``: the decoder's linear layers on the GGUF's own Q4_1 weights
  (:class:`~iterserve.kernels.quantized_linear.Int4Linear`) for the batch sizes where the
  int4 kernel measured faster than bfloat16, bfloat16 (de-quantized from the same blocks)
  elsewhere; the LM head (the default model's Q8_0 embeddings, tied) stays bfloat16.

Which kernel runs is chosen per call by the number of rows (the iteration's tokens: a decode
of a few requests is a handful, a prefill chunk hundreds), from timings taken at start on
this CPU (:func:`measure_kernels`), not assumed: the int4 kernel reads a quarter of the
bytes but computes slowly, so it wins small decode batches only; oneDNN's int8 GEMM halves
the bytes and doubles the multiply rate of bfloat16 on VNNI (2-4x faster from 32 rows on
CPUs without AMX), while where AMX runs bfloat16 it wins small batches only.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
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
    QuantizedRows,
    RowsDispatch,
    int4_linear_available,
    int8_linear_available,
    smoothing_factors,
)
from iterserve.models.gguf_q4 import NotQ4Error, read_q4_linears
from iterserve.models.llama import LlamaForCausalLM
from iterserve.models.loader import source_gguf
from iterserve.models.parallel import SINGLE, TPGroup

logger = logging.getLogger(__name__)

# Row counts (tokens of an iteration) at which the kernels are timed, ascending.
MEASURED_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MEASURE_REPEATS = 3
# A kernel falling behind the fastest past this factor at two row counts in a row is not
# timed further (the int4 kernel from ~16 rows: its passes grow to seconds).
DROP_FACTOR = 1.5
# SmoothQuant's migration strength and the calibration forward's length (docs/engine.md).
SMOOTHING_ALPHA = 0.5
CALIBRATION_TOKENS = 512
EVERY_BATCH = 1 << 20  # a fixed plan's rows from here on read "at every batch size"
BASELINE = "bf16"  # never dropped from the timings: any kernel may fall behind it and recover
LM_HEAD = "lm_head"  # the LM head's name beside model.linear_layers()' names


@dataclass(frozen=True)
class QuantizationPlan:
    """What ``--quantization`` chose on this machine.

    Attributes:
        mode: ``int8`` or ``q4``.
        segments: ``(max_rows, kernel)`` ascending: the kernel (``bf16``, ``int8``, ``q4``)
            for up to ``max_rows`` rows (and more than the previous segment's).
        above: the kernel past the last segment.
        timings_ms: rows -> kernel -> milliseconds of one pass over all the layers, as
            measured (empty when ``ITERSERVE_QUANTIZED_MAX_ROWS`` fixed the plan).
    """

    mode: str
    segments: tuple[tuple[int, str], ...]
    above: str
    timings_ms: dict[int, dict[str, float]] = field(default_factory=dict)

    def kernel_for(self, rows: int) -> str:
        return next((kind for max_rows, kind in self.segments if rows <= max_rows), self.above)

    def describe(self) -> str:
        parts, low = [], 1
        for max_rows, kind in self.segments:
            if max_rows >= EVERY_BATCH:
                parts.append(f"{kind} at every batch size")
                break
            span = f"{low} token" if low == max_rows else f"{low}-{max_rows} tokens"
            parts.append(f"{kind} for {span}")
            low = max_rows + 1
        else:
            parts.append(f"{self.above} {'above' if self.segments else 'at every batch size'}")
        if not self.timings_ms:
            return f"{self.mode}: {', '.join(parts)} (ITERSERVE_QUANTIZED_MAX_ROWS)"
        measured = "; ".join(
            f"{rows}: " + " ".join(f"{k} {ms:.1f}" for k, ms in times.items())
            for rows, times in self.timings_ms.items()
        )
        return f"{self.mode}: {', '.join(parts)} (ms for all linears, {measured})"


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
            "file nor a directory holding one (use --quantization int8, or give the .gguf)"
        )
    return gguf


def _bf16_op(platform: Platform, weight: torch.Tensor) -> LinearOp:
    packed = platform.pack_linear_weight(weight)
    if packed is not None:
        return packed
    plain = weight.detach()
    return lambda x, bias: F.linear(x, plain, bias)


# int8 layers whose input the model quantizes in a pass it runs anyway (the norm before q, k, v
# and gate_up; SwiGLU before down), and the one whose float32 output SwiGLU's fused pass takes
# in place of the rescale: timed without those passes (llama.LlamaDecoderLayer).
FUSED_INPUT = ("qkv_proj", "gate_up_proj", "down_proj")
FUSED_OUTPUT = ("gate_up_proj",)


class _AsFused:
    """An :class:`Int8Linear` timed as the model runs it after a fused pass: its input
    quantized beforehand (once per input, in the untimed first pass of :func:`_time_all`),
    its output left in float32 where SwiGLU's fused pass rescales it."""

    def __init__(self, op: Int8Linear, rescale: bool) -> None:
        self.op, self.rescale = op, rescale
        self._input: tuple[tuple[int, int], QuantizedRows] | None = None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        key = (x.data_ptr(), x.shape[0])
        if self._input is None or self._input[0] != key:
            self._input = (key, self.op.quantize_input(x))
        rows = self._input[1]
        return self.op(rows, bias) if self.rescale else self.op.accumulate(rows)[0]


def timed_as_run(name: str, op: LinearOp) -> LinearOp:
    """``op`` as :func:`measure_kernels` should time it for the layer ``name``: an int8 layer
    after a fused pass without the passes the model fuses away (:data:`FUSED_INPUT`)."""
    layer = name.rsplit(".", 1)[-1]
    if not isinstance(op, Int8Linear) or layer not in FUSED_INPUT:
        return op
    return _AsFused(op, rescale=layer not in FUSED_OUTPUT)


def _time_all(ops: Sequence[LinearOp], inputs: Sequence[torch.Tensor]) -> float:
    """Fewest seconds of :data:`MEASURE_REPEATS` passes over every op in turn (a pass before,
    not timed): the least disturbed by whatever else runs at start."""
    times = []
    for i in range(MEASURE_REPEATS + 1):
        start = time.perf_counter()
        for op, x in zip(ops, inputs, strict=True):
            op(x, None)
        if i:
            times.append(time.perf_counter() - start)
    return min(times)


def measure_kernels(
    kernels: Mapping[str, Sequence[LinearOp]], in_features: Sequence[int]
) -> tuple[list[tuple[int, str]], dict[int, dict[str, float]]]:
    """The fastest kernel at each of :data:`MEASURED_ROWS`, timed here.

    At each row count, ascending, one pass over all the model's layers per kernel (every
    weight read from memory, as in a forward, not from a warm cache), median of
    :data:`MEASURE_REPEATS` (the fastest). A quantized kernel falling behind the fastest
    (slower by more than :data:`DROP_FACTOR`, and by more than at the previous row count) at
    two row counts in a row is not timed again (bfloat16 always is), and the measuring ends
    when one kernel is left. :func:`one_switch` turns the timings into a plan.

    Args:
        kernels: name -> one op per layer, the same layers in the same order in each.
        in_features: each layer's input width.

    Returns:
        ``(choices, timings)``: ``(rows, fastest kernel)`` per row count measured; rows ->
        kernel -> milliseconds.
    """
    active, strikes = list(kernels), dict.fromkeys(kernels, 0)
    ratios: dict[str, float] = {}  # each kernel's time over the fastest's, last row count
    choices: list[tuple[int, str]] = []
    timings: dict[int, dict[str, float]] = {}
    with torch.inference_mode():
        first = {k: torch.randn(1, k, dtype=torch.bfloat16) for k in set(in_features)}
        for ops in kernels.values():  # first calls' one-off costs (page faults, primitives)
            _time_all(ops, [first[k] for k in in_features])
        for rows in MEASURED_ROWS:
            widths = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in set(in_features)}
            inputs = [widths[k] for k in in_features]
            times = {name: _time_all(kernels[name], inputs) for name in active}
            best = min(times, key=lambda name: times[name])
            choices.append((rows, best))
            timings[rows] = {name: t * 1e3 for name, t in times.items()}
            for name in [n for n in active if n != BASELINE]:
                ratio = times[name] / times[best]
                losing = ratio > DROP_FACTOR and ratio > ratios.get(name, 0.0)
                strikes[name] = strikes[name] + 1 if losing else 0
                ratios[name] = ratio
                if strikes[name] >= 2:
                    active.remove(name)
            if len(active) == 1:
                break
    return choices, timings


def one_switch(
    timings: Mapping[int, Mapping[str, float]],
) -> tuple[tuple[tuple[int, str], ...], str]:
    """The plan with at most one switch of kernel that costs least over the measured row
    counts: ``(segments, above)``, one kernel below the switch and one above (or one for all).
    Each row count's cost is the chosen kernel's time over the fastest's there, so every row
    count weighs alike and a noisy one cannot carve a segment of its own; a kernel not timed
    at a row count (dropped as hopeless) cannot be chosen there.

    Args:
        timings: rows (ascending) -> kernel -> time, as :func:`measure_kernels` returns.
    """
    rows = list(timings)
    kinds = sorted({kind for times in timings.values() for kind in times})

    def cost(kind: str, r: int) -> float:
        times = timings[r]
        return times[kind] / min(times.values()) if kind in times else math.inf

    best: tuple[float, int, str, str] = (math.inf, 0, kinds[0], kinds[0])
    for low in kinds:
        for high in kinds:
            for split in range(len(rows) + 1):  # rows[:split] on `low`, the rest on `high`
                total = sum(cost(low, r) for r in rows[:split])
                total += sum(cost(high, r) for r in rows[split:])
                if total < best[0] - 1e-9:
                    best = (total, split, low, high)
    _, split, low, high = best
    if split == 0 or low == high:
        return (), high if split < len(rows) else low
    if split == len(rows):
        return (), low
    return ((rows[split - 1], low),), high


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
    """Per linear layer (and :data:`LM_HEAD`), ``max |x_j|`` of its input columns over one
    forward of ``token_ids`` (one sequence) through the bfloat16 model: SmoothQuant's
    calibration statistic. A model served with fewer positions than ``token_ids`` (``--max-model-len
    64``) sees them as consecutive sequences of at most that many tokens."""
    stats: dict[str, torch.Tensor] = {}

    def keep(name: str, x: torch.Tensor) -> None:
        seen = x.detach().float().abs().amax(dim=0)
        stats[name] = torch.maximum(stats[name], seen) if name in stats else seen

    def record(name: str) -> Any:
        return lambda module, args: keep(name, args[0])

    handles = [m.register_forward_pre_hook(record(n)) for n, m in model.linear_layers()]
    span = int(model.rotary.cos.shape[0])  # the positions the rotary tables hold
    try:
        for start in range(0, len(token_ids), span):
            ids = torch.tensor(token_ids[start : start + span], dtype=torch.int64)
            keep(LM_HEAD, model(ids, torch.arange(len(ids)), _causal_attention))
    finally:
        for handle in handles:
            handle.remove()
    return stats


def _plan(
    mode: str,
    kernels: Mapping[str, Sequence[LinearOp]],
    in_features: Sequence[int],
    tp: TPGroup = SINGLE,
) -> QuantizationPlan:
    """Measured (:func:`measure_kernels`) by the driver and adopted by every tensor-parallel
    rank (ranks timing their own could pick different kernels for one batch, and their
    shards' sums would then differ from one rank's), or fixed by
    ``ITERSERVE_QUANTIZED_MAX_ROWS``: the quantized kernel up to that many rows, bfloat16
    above (0: bfloat16 only)."""
    try:
        fixed = envs.quantized_max_rows()
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if fixed is not None:
        if fixed == 0:
            return QuantizationPlan(mode, (), "bf16")
        return QuantizationPlan(mode, ((fixed, mode),), "bf16")
    if not tp.is_driver:
        return tp.from_driver(QuantizationPlan(mode, (), BASELINE))  # the argument is ignored
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if load > 0.5 * (cores or 1):
        logger.warning(
            "timing the quantized kernels under a load average of %.1f on %d cores: the plan "
            "may be off; ITERSERVE_QUANTIZED_MAX_ROWS fixes it instead",
            load,
            cores,
        )
    _, timings = measure_kernels(kernels, in_features)
    segments, above = one_switch(timings)
    return tp.from_driver(QuantizationPlan(mode, segments, above, timings))


def _dispatch(plan: QuantizationPlan, kernels: Mapping[str, Sequence[LinearOp]]) -> list[LinearOp]:
    """One op per layer following ``plan`` (a kernel the plan never picks is dropped)."""
    num_layers = len(next(iter(kernels.values())))
    ops: list[LinearOp] = []
    for i in range(num_layers):
        above = kernels[plan.above][i]
        segments = [(rows, kernels[kind][i]) for rows, kind in plan.segments]
        ops.append(RowsDispatch(segments, above) if segments else above)
    return ops


def quantize_linears(
    model: LlamaForCausalLM, mode: str, model_dir: Path, gguf: Path | None, hf_config: Any
) -> QuantizationPlan:
    """Put the loaded (bfloat16) model's linear layers on ``mode``'s kernels, each choosing
    by rows from the timings taken here (:func:`measure_kernels`); the plain weights are
    freed. Instead of :meth:`~iterserve.models.llama.LlamaForCausalLM.pack_linear_weights`,
    once after loading.

    ``int8`` smooths each layer's activations first (:func:`~iterserve.kernels.
    quantized_linear.smoothing_factors`, alpha :data:`SMOOTHING_ALPHA`) from one calibration
    forward (:func:`input_absmax` over :func:`calibration_token_ids`), the LM head's too.

    Raises:
        ConfigError: ``q4`` on a file whose linear weights are not all Q4_1.
    """
    layers = model.linear_layers()
    platform = model.platform
    weights = [module.weight for _, module in layers] + [model.lm_head_weight]
    in_features = [w.shape[1] for w in weights]
    kernels: dict[str, list[LinearOp]] = {"bf16": [_bf16_op(platform, w) for w in weights]}
    if mode == "int8":
        absmax = input_absmax(model, calibration_token_ids(model_dir))
        kernels["int8"] = [
            Int8Linear(w, smoothing_factors(absmax[name], w, SMOOTHING_ALPHA))
            for name, w in zip([*(n for n, _ in layers), LM_HEAD], weights, strict=True)
        ]
    else:
        assert gguf is not None, "check_quantization gives q4 its file"
        try:
            q4 = read_q4_linears(gguf, hf_config)
        except NotQ4Error as e:
            raise ConfigError(f"--quantization q4: {e}") from e
        # The LM head has no Q4_1 blocks: its bfloat16 op in the q4 list too.
        kernels["q4"] = [*(Int4Linear(q4[name]) for name, _ in layers), kernels["bf16"][-1]]
    names = [*(n for n, _ in layers), LM_HEAD]
    timed = {
        kind: [timed_as_run(name, op) for name, op in zip(names, ops, strict=True)]
        for kind, ops in kernels.items()
    }
    plan = _plan(mode, timed, in_features, model.tp)
    ops = _dispatch(plan, kernels)
    model.install_linear_ops(dict(zip((n for n, _ in layers), ops[:-1], strict=True)), ops[-1])
    logger.info("quantization %s", plan.describe())
    return plan
