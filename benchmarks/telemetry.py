"""``python -m benchmarks.telemetry``: iterations per second of the engine loop with and without
``--telemetry-db``, in one invocation on the same workload.

The engine is the real scheduler and block manager over the simulated runner in virtual time
(no model, no waiting: an iteration costs only the engine's own Python work, plus pickling its
``StepResult`` as the engine process does), the worst case for the relative cost of the
``scheduler_iterations`` row each iteration queues; a model's forward only adds to the
denominator. After one uncounted warm-up run, each of ``--repeats`` repeats runs both modes,
in alternating order; the table shows the medians, and the time the engine loop spent queueing
rows (``record_us_per_iteration``: the producer's side, measured around each call; the writer
thread's share of the GIL shows only in iterations/s). The HTTP process's rows (one per
request, not per iteration) are not timed.

Run: ``python -m benchmarks.telemetry``.
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from iterserve.bench.common import output_dir, warn_if_loaded
from iterserve.engine.engine_core import EngineCore
from iterserve.engine.messages import AddRequest, EngineMessage, IterationStats
from iterserve.engine.sampling_params import SamplingParams
from iterserve.sim.profile import load_profile
from iterserve.sim.replica import VirtualClock, build_simulated_engine
from iterserve.telemetry.iterations import IterationRecorder


class _TimedRecorder(IterationRecorder):
    """Adds up the time the engine loop spends queueing rows."""

    seconds = 0.0

    def record(self, first_iteration_id: int, iterations: Sequence[IterationStats]) -> int:
        start = time.perf_counter()
        try:
            return super().record(first_iteration_id, iterations)
        finally:
            self.seconds += time.perf_counter() - start


def run_once(args: argparse.Namespace, db: str | None) -> dict[str, Any]:
    """One run of the workload; ``db`` None: telemetry off. Iterations, seconds, rows."""
    clock = VirtualClock()
    kwargs = {"max_num_seqs": args.concurrency, "num_kv_blocks": args.num_kv_blocks}
    engine, _ = build_simulated_engine(load_profile("cpu-smollm2"), kwargs, clock.advance, clock)
    recorder = _TimedRecorder(db) if db else None

    def send(message: EngineMessage) -> None:
        pickle.dumps(message)  # as the engine process does for its pipe

    core = EngineCore(engine, send, recorder)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for i in range(args.num_requests):
        prompt = [(7 * i + j) % 40000 + 100 for j in range(args.prompt_len)]
        core.apply(AddRequest(f"r{i}", prompt, params, 1, clock()))
    first = engine.num_iterations
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        core.step()
    seconds = time.perf_counter() - start
    num_iterations = engine.num_iterations - first
    dropped = written = 0
    if recorder is not None:
        recorder.close()
        dropped = recorder.writer.num_dropped["scheduler_iterations"]
        written = recorder.writer.num_written["scheduler_iterations"]
    return {
        "iterations": num_iterations,
        "seconds": seconds,
        "iterations_per_s": num_iterations / seconds,
        "rows_written": written,
        "rows_dropped": dropped,
        "record_us_per_iteration": (recorder.seconds if recorder else 0) / num_iterations * 1e6,
    }


def format_table(result: dict[str, Any]) -> str:
    lines = ["mode  iterations/s (median)  runs  rows written  rows dropped  record us/iteration"]
    for mode in ("off", "on"):
        m = result[mode]
        lines.append(
            f"{mode:>4}  {m['iterations_per_s_median']:>21.0f}  {len(m['runs']):>4}  "
            f"{m['rows_written']:>12}  {m['rows_dropped']:>12}  {m['record_us_median']:>19.1f}"
        )
    lines.append(f"on / off: {result['on_over_off']:.3f}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    warn_if_loaded()
    if args.smoke:
        args.num_requests, args.max_tokens, args.repeats = 4, 4, 1
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        run_once(args, str(Path(tmp) / "warm-up.db"))  # imports, caches: not counted
        for repeat in range(args.repeats):
            for mode in ("off", "on") if repeat % 2 == 0 else ("on", "off"):
                gc.collect()
                db = str(Path(tmp) / f"telemetry-{repeat}.db") if mode == "on" else None
                runs[mode].append(run_once(args, db))
    result: dict[str, Any] = {
        "workload": {
            k: getattr(args, k)
            for k in ("num_requests", "concurrency", "prompt_len", "max_tokens", "repeats")
        }
    }
    for mode, got in runs.items():
        result[mode] = {
            "runs": got,
            "iterations_per_s_median": statistics.median(r["iterations_per_s"] for r in got),
            "rows_written": sum(r["rows_written"] for r in got),
            "rows_dropped": sum(r["rows_dropped"] for r in got),
            "record_us_median": statistics.median(r["record_us_per_iteration"] for r in got),
        }
    result["on_over_off"] = (
        result["on"]["iterations_per_s_median"] / result["off"]["iterations_per_s_median"]
    )
    print(format_table(result))
    out = output_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "telemetry.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'telemetry.json'}")
    return 0


if __name__ == "__main__":
    from benchmarks.cli_args import parse_args

    raise SystemExit(main(parse_args("telemetry")))
