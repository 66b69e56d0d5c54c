"""Decode-iteration roofline: the full iteration against its parts, in one run.

For each (batch, context) :func:`run_decode_bench` times, on the same loaded model:

- ``iteration``: one real decode iteration through the model runner (input preparation,
  forward with paged attention, logits, sampling), median of ``iters`` runs;
- ``linears``: the model's own linear layers alone at that batch (fused qkv, o, gate-up,
  down in every layer, and the LM head);
- ``floor``: the memory floor, (weight bytes + KV bytes read) / the bandwidth of a large
  copy measured in the same run (read + write counted, as the design notes do).

``iterserve bench offline`` prints these rows under its throughput table; the repository's
``python -m benchmarks.decode`` runs them alone and plots them.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from iterserve.bench.common import cpu_capabilities
from iterserve.config import EngineConfig
from iterserve.engine.outputs import ScheduledRequest, SchedulerOutput
from iterserve.engine.sampling_params import SamplingParams


@dataclass
class DecodeRow:
    batch: int
    context: int
    iteration_ms: float
    linears_ms: float
    floor_ms: float
    weight_bytes: int
    kv_bytes: int

    @property
    def vs_linears(self) -> float:
        return self.iteration_ms / self.linears_ms

    @property
    def vs_floor(self) -> float:
        return self.iteration_ms / self.floor_ms


def median_seconds(fn: Callable[[], Any], iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(num_bytes: int = 256 << 20, iters: int = 5) -> float:
    """Bytes per second of a large tensor copy, read + write counted."""
    src = torch.empty(num_bytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    return 2 * num_bytes / median_seconds(lambda: dst.copy_(src), iters)


def decode_batch(batch: int, context: int, block_size: int) -> SchedulerOutput:
    """``batch`` requests each decoding its ``context``-th token, on disjoint blocks."""
    num_blocks = -(-context // block_size)
    greedy = SamplingParams(temperature=0.0)
    scheduled = [
        ScheduledRequest(
            request_id=f"bench-{i}",
            token_ids=[100 + i],
            num_computed_tokens=context - 1,
            block_table=list(range(i * num_blocks, (i + 1) * num_blocks)),
            sample=True,
            sampling_params=greedy,
            prompt_token_ids=[1],
        )
        for i in range(batch)
    ]
    return SchedulerOutput(scheduled=scheduled)


@torch.inference_mode()
def linears_only(model: Any, batch: int) -> Callable[[], None]:
    hidden = model.config.hidden_size
    dtype = model.embed_tokens.weight.dtype
    x = torch.randn(batch, hidden, dtype=dtype)
    o_in = torch.randn(batch, model.layers[0].q_size, dtype=dtype)
    down_in = torch.randn(batch, model.config.intermediate_size, dtype=dtype)

    def run() -> None:
        with torch.inference_mode():
            for layer in model.layers:
                layer.qkv_proj(x)
                layer.o_proj(o_in)
                layer.gate_up_proj(x)
                layer.down_proj(down_in)
            model.compute_logits(x)

    return run


def run_decode_bench(
    shapes: list[tuple[int, int]],
    dtype: str,
    iters: int,
    model: str = "default",
    copy_bytes: int = 256 << 20,
    quantization: str = "none",
) -> tuple[list[DecodeRow], dict[str, Any]]:
    """One :class:`DecodeRow` per (batch, context) of ``shapes`` on ``model`` in ``dtype``
    (median of ``iters`` timings each; ``quantization``: the engine's ``--quantization``), and
    the run's facts (``copy_bandwidth_gb_s`` of a ``copy_bytes`` copy, dtype, quantization,
    torch version, threads, the CPU's capability line, load average)."""
    from iterserve.executor.build import build

    block_size = 16
    num_blocks = max(b * -(-c // block_size) for b, c in shapes)
    loaded = build(
        EngineConfig.from_kwargs(
            model=model,
            dtype=dtype,
            num_kv_blocks=num_blocks,
            block_size=block_size,
            quantization=quantization,
        )
    )
    runner = loaded.driver
    weight_bytes = runner.model.weight_bytes()
    bandwidth = copy_bandwidth(copy_bytes)
    rows = []
    for batch, context in shapes:
        out = decode_batch(batch, context, block_size)

        def one_iteration(out: SchedulerOutput = out) -> None:
            runner.execute_model(out)

        iteration = median_seconds(one_iteration, iters)
        linears = median_seconds(linears_only(runner.model, batch), iters)
        kv_bytes = batch * context * runner.kv_cache.bytes_per_token
        floor = (weight_bytes + kv_bytes) / bandwidth
        rows.append(
            DecodeRow(
                batch, context, iteration * 1e3, linears * 1e3, floor * 1e3, weight_bytes, kv_bytes
            )
        )
    meta = {
        "dtype": str(runner.model.embed_tokens.weight.dtype),
        "quantization": quantization,
        "cpu": cpu_capabilities(),
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "load_average_at_start": os.getloadavg()[0],
    }
    return rows, meta


def format_table(rows: list[DecodeRow]) -> str:
    lines = [
        f"{'batch':>5} {'ctx':>5} {'iteration ms':>13} {'linears ms':>11} {'x linears':>9} "
        f"{'floor ms':>9} {'x floor':>8}"
    ]
    for r in rows:
        lines.append(
            f"{r.batch:>5} {r.context:>5} {r.iteration_ms:>13.1f} {r.linears_ms:>11.1f} "
            f"{r.vs_linears:>9.2f} {r.floor_ms:>9.1f} {r.vs_floor:>8.2f}"
        )
    return "\n".join(lines)
