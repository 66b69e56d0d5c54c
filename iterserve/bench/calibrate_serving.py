"""``bench calibrate``'s serve stage: what the serving side adds beside the engine.

The grid times the engine in-process. A server also runs an HTTP process (parse, tokenize,
admission, one SSE event per token) and, on a benchmark machine, the load generator; on 2
cores they take CPU from the engine's threads, and a forward whose threads meet at a barrier
waits for the one that lost its core. Measured on this project's 2-core Xeon (2026-12-06),
the same trace's iterations were 5% over the grid's prediction replayed in-process and 20%
over it through ``iterserve serve`` with ``bench serve``'s client beside it
(docs/simulator.md, "The serving side").

So after the grid, a real ``iterserve serve`` (the calibrated model and dtype, server
defaults) gets three loads from ``bench serve``'s client in this process, each weighing the
costs differently:

- **sequential**: requests one at a time (one token per iteration);
- **concurrent**: a closed loop of 8 (about 8 tokens per iteration);
- **burst**: 16 short requests of 2 tokens at once (requests, few tokens or iterations).

Each load's CPU outside the engine (the HTTP process from ``/proc``, less its idle rate
measured over :data:`IDLE_S` first; the client's own ``process_time``) over its engine
iterations (the server's counter), streamed tokens and requests gives, by non-negative
least squares over the loads, :class:`~iterserve.sim.profile.ServingCosts`'
``cpu_per_iteration_s``, ``cpu_per_token_s`` and ``cpu_per_request_s``; a replay adds that
CPU to the iteration it overlaps. The sequential load's TTFT beyond what the replay predicts
for it (medians) is ``request_latency_s``: the way from the HTTP request to the engine and of
the first token back, which no iteration covers. The concurrent load replayed on the
finished profile is the stage's own check (its TPOT p50 and TTFT p50, measured against
simulated, in the report and the notes).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import nnls  # type: ignore[import-untyped]

from iterserve.bench.fidelity_real import (
    client_args,
    cpu_seconds,
    real_server,
    scrape,
    warm_up,
)
from iterserve.bench.serve import run_load
from iterserve.sim.profile import LatencyProfile, ServingCosts
from iterserve.workload.stats import RequestRecord
from iterserve.workload.workloads import BenchRequest, PromptCutter


@dataclass(frozen=True)
class Load:
    """One load of the stage: ``num_requests`` prompts of ``prompt_len`` tokens, each
    streaming ``output_len`` tokens, ``concurrency`` at a time."""

    name: str
    num_requests: int
    prompt_len: int
    output_len: int
    concurrency: int


# Three loads that weigh the three costs differently: one token per iteration (sequential),
# ~8 tokens per iteration (concurrent), many requests for few tokens and iterations (burst).
SEQUENTIAL = Load("sequential", 8, 96, 8, 1)
CONCURRENT = Load("concurrent", 24, 96, 48, 8)
BURST = Load("burst", 16, 32, 2, 16)
SMOKE_LOADS = (
    Load("sequential", 3, 32, 4, 1),
    Load("concurrent", 8, 32, 8, 4),
    Load("burst", 6, 16, 2, 6),
)
IDLE_S = 2.0  # the HTTP process's CPU while idle is measured over this long


@dataclass
class LoadResult:
    """What one load gave: its requests, what the client saw, the CPU beside the engine."""

    load: Load
    requests: list[BenchRequest]
    records: list[RequestRecord]
    cpu_s: float  # the HTTP process's and the client's, less the idle rate over the load
    num_tokens: int  # streamed
    num_iterations: int  # the engine's, from the server's metrics


def _requests(load: Load, cutter: PromptCutter) -> list[BenchRequest]:
    return [
        BenchRequest(cutter.cut(load.prompt_len), load.prompt_len, load.output_len)
        for _ in range(load.num_requests)
    ]


def _iterations(url: str) -> int:
    return int(scrape(url)[1][1])


def _run(
    url: str, http_pid: int, model: str, load: Load, cutter: PromptCutter, idle_cores: float
) -> LoadResult:
    """``load`` through the server; what the client saw and the CPU spent beside the engine.

    Raises:
        RuntimeError: a request failed (the stage's figures would be wrong).
    """
    requests = _requests(load, cutter)
    http_before, iterations_before = cpu_seconds(http_pid), _iterations(url)
    records, wall, client_cpu = asyncio.run(
        run_load(url, requests, model, client_args(0, load.concurrency), float("inf"))
    )
    http_cpu = cpu_seconds(http_pid) - http_before
    num_iterations = _iterations(url) - iterations_before
    failed = [r for r in records if not r.ok]
    if failed:
        raise RuntimeError(
            f"serve stage, {load.name} load: {len(failed)} of {len(records)} requests failed "
            f"({failed[0].status}: {failed[0].error})"
        )
    cpu = max(0.0, http_cpu - idle_cores * wall) + client_cpu
    num_tokens = sum(r.output_tokens for r in records)
    return LoadResult(load, requests, records, cpu, num_tokens, num_iterations)


def fit_cpu_costs(results: list[LoadResult]) -> tuple[float, float, float]:
    """(seconds per iteration, per streamed token, per request) fitted to the loads' CPU by
    non-negative least squares (columns normalised: their counts differ by 10-100x).

    Raises:
        ValueError: fewer loads than costs.
    """
    if len(results) < 3:
        raise ValueError(f"three costs need three loads or more, got {len(results)}")
    x = np.array([[r.num_iterations, r.num_tokens, len(r.records)] for r in results], dtype=float)
    y = np.array([r.cpu_s for r in results], dtype=float)
    scale = x.max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(x / scale, y)
    per_iteration, per_token, per_request = (float(c) for c in coef / scale)
    return per_iteration, per_token, per_request


def _idle_cores(http_pid: int) -> float:
    """The HTTP process's CPU while nothing is served (cores), over :data:`IDLE_S`."""
    before = cpu_seconds(http_pid)
    time.sleep(IDLE_S)
    return (cpu_seconds(http_pid) - before) / IDLE_S


def _replay(result: LoadResult, profile: LatencyProfile, tokenizer: Any, model_dir: Path) -> Any:
    from iterserve.sim.replay import replay

    engine_kwargs = {"model": str(model_dir)}
    return replay(
        result.requests, profile, engine_kwargs, tokenizer, concurrency=result.load.concurrency
    )


def _median_ttft(records: list[RequestRecord]) -> float:
    return statistics.median(r.ttft_s for r in records if r.ttft_s is not None)


def _median_tpot(records: list[RequestRecord]) -> float:
    tpots = [t for r in records if (t := r.tpot_s) is not None]
    return statistics.median(tpots) if tpots else 0.0


@dataclass(frozen=True)
class ServeCheck:
    """The concurrent load, measured and replayed on the finished profile (seconds)."""

    tpot_measured_s: float
    tpot_simulated_s: float
    ttft_measured_s: float
    ttft_simulated_s: float


def measure_serving(
    profile: LatencyProfile, model: str, dtype: str, smoke: bool, log: Path
) -> tuple[ServingCosts, list[str], ServeCheck]:
    """Run the stage (module docstring) on a fresh server; the costs, a line per finding for
    the report and the profile's notes, and the check.

    Args:
        profile: the grid's fit (its ``serving`` is ignored and replaced).
        model, dtype: as the calibration's (``--model``, ``--dtype``).
        smoke: the tiny loads (tests).
        log: the server's output.

    Raises:
        FidelityError: the server did not start (its log's tail).
        RuntimeError: a request of a load failed.
        httpx.HTTPError: the server stopped answering (its metrics) mid-stage.
    """
    from iterserve.models.loader import resolve_model_dir
    from iterserve.sim.tokenizer import FileTokenizer

    model_dir = resolve_model_dir(model)
    tokenizer = FileTokenizer(model_dir)
    cutter = PromptCutter(tokenizer, random.Random(0))
    flags = ["--model", model, "--dtype", dtype]
    loads = SMOKE_LOADS if smoke else (SEQUENTIAL, CONCURRENT, BURST)
    with real_server(0, flags, log) as (url, pid):
        served = warm_up(url)
        idle = _idle_cores(pid)
        results = [_run(url, pid, served, load, cutter, idle) for load in loads]
    per_iteration, per_token, per_request = fit_cpu_costs(results)
    costs = ServingCosts(
        cpu_per_iteration_s=per_iteration,
        cpu_per_token_s=per_token,
        cpu_per_request_s=per_request,
    )
    sequential, concurrent = results[0], results[1]
    no_latency = profile.model_copy(update={"serving": costs})
    simulated = _replay(sequential, no_latency, tokenizer, model_dir)
    latency = max(0.0, _median_ttft(sequential.records) - _median_ttft(simulated.records))
    costs = costs.model_copy(update={"request_latency_s": latency})
    check = _replay(concurrent, profile.model_copy(update={"serving": costs}), tokenizer, model_dir)
    notes = [
        f"serve stage: CPU beside the engine (HTTP process + client) {per_iteration * 1e3:.3f} "
        f"ms per iteration, {per_token * 1e3:.3f} ms per streamed token, "
        f"{per_request * 1e3:.2f} ms per request, fitted over "
        + ", ".join(f"{r.load.name} {r.cpu_s:.2f} s for {r.num_iterations} iterations, "
                    f"{r.num_tokens} tokens, {len(r.records)} requests" for r in results)
        + f" (HTTP idle {idle:.3f} cores, subtracted); request latency {latency * 1e3:.1f} ms "
        f"(sequential TTFT p50 {_median_ttft(sequential.records) * 1e3:.1f} ms measured, "
        f"{_median_ttft(simulated.records) * 1e3:.1f} ms replayed without it)",
        f"serve stage check, {concurrent.load.num_requests} requests at concurrency "
        f"{concurrent.load.concurrency}: TPOT p50 {_median_tpot(concurrent.records) * 1e3:.1f} ms "
        f"measured, {_median_tpot(check.records) * 1e3:.1f} ms simulated; TTFT p50 "
        f"{_median_ttft(concurrent.records) * 1e3:.1f} ms measured, "
        f"{_median_ttft(check.records) * 1e3:.1f} ms simulated",
    ]  # fmt: skip
    check_result = ServeCheck(
        _median_tpot(concurrent.records),
        _median_tpot(check.records),
        _median_ttft(concurrent.records),
        _median_ttft(check.records),
    )
    return costs, notes, check_result
