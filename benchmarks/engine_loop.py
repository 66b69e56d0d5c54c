"""Engine loop on a thread or in its own process: which keeps iterations faster under
HTTP-like work on the event loop? Both run in one invocation on the same workload.

Each of ``--concurrency`` streams gets its outputs on an asyncio loop, which does the work an
SSE handler does per token: build an OpenAI ``chat.completion.chunk`` dict and ``json.dumps``
it (plus ``--extra-us`` of busy Python, to model a heavier HTTP stack).

- ``thread``: :class:`~iterserve.engine.async_engine.AsyncEngine` (the engine loop on a
  thread of this process, sharing the GIL with the event loop).
- ``process``: :class:`~iterserve.engine.process_engine.ProcessEngine` (the engine loop in a
  child process; commands and each iteration's outputs cross pipes, pickled, as vLLM v1's
  engine-core process does).

Run: ``python -m benchmarks.engine_loop``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

from iterserve.bench.common import output_dir, warn_if_loaded
from iterserve.config import EngineConfig
from iterserve.engine.messages import AddRequest, RequestDelta
from iterserve.engine.sampling_params import SamplingParams


@dataclass
class LoopResult:
    mode: str
    output_tokens: int
    seconds: float
    median_itl_ms: float
    p99_itl_ms: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"dtype": args.dtype, "num_kv_blocks": args.num_kv_blocks, "max_num_seqs": 64}


def _build_engine(kwargs: dict[str, Any]) -> Any:
    from iterserve.engine.factory import build_engine
    from iterserve.executor.build import build

    loaded = build(EngineConfig.from_kwargs(**kwargs))
    engine = build_engine(loaded.config, loaded.runner, loaded.tokenizer, loaded.info)
    return engine, loaded.tokenizer


def _sse_work(delta: RequestDelta, extra_us: float) -> int:
    """What an SSE handler does per output; returns bytes produced."""
    choices = [
        {"index": c.index, "delta": {"content": c.new_text}, "finish_reason": c.finish_reason}
        for c in delta.completions
    ]
    chunk = {
        "id": delta.request_id,
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "SmolLM2-135M-Instruct",
        "choices": choices,
    }
    data = f"data: {json.dumps(chunk)}\n\n"
    end = time.perf_counter() + extra_us / 1e6
    while time.perf_counter() < end:
        pass
    return len(data)


async def _consume(stream: Any, extra_us: float, gaps: list[float]) -> int:
    last = time.perf_counter()
    num_tokens = 0
    async for delta in stream:
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        _sse_work(delta, extra_us)
        num_tokens += sum(len(c.new_token_ids) for c in delta.completions)
    return num_tokens


def _workload(tokenizer: Any, concurrency: int) -> list[list[int]]:
    text = "Tell me a long story about a robot who learns to paint. " * 4
    ids = list(tokenizer(text).input_ids)
    return [ids[: 40 + (i % 8) * 4] for i in range(concurrency)]


async def _drive(
    mode: str,
    client: Any,
    prompts: list[list[int]],
    args: argparse.Namespace,
    params: SamplingParams,
) -> LoopResult:
    """Stream every prompt through a started client at once; stop the client at the end."""
    gaps: list[float] = []
    start = time.perf_counter()
    try:
        counts = await asyncio.gather(
            *[
                _consume(
                    client.generate(AddRequest(str(i), p, params, 1, time.monotonic())),
                    args.extra_us,
                    gaps,
                )
                for i, p in enumerate(prompts)
            ]
        )
    finally:
        await client.stop()
    return _result(mode, sum(counts), time.perf_counter() - start, gaps)


async def _run_thread(args: argparse.Namespace, params: SamplingParams) -> LoopResult:
    from iterserve.engine.async_engine import AsyncEngine

    engine, tokenizer = _build_engine(_engine_kwargs(args))
    client = AsyncEngine(engine)
    await client.start()
    return await _drive("thread", client, _workload(tokenizer, args.concurrency), args, params)


async def _run_process(args: argparse.Namespace, params: SamplingParams) -> LoopResult:
    from transformers import AutoTokenizer

    from iterserve.engine.process_engine import ProcessEngine
    from iterserve.models.loader import resolve_model_dir

    client = ProcessEngine(_engine_kwargs(args))
    await client.start()
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir("default")))
    return await _drive("process", client, _workload(tokenizer, args.concurrency), args, params)


def _result(mode: str, tokens: int, seconds: float, gaps: list[float]) -> LoopResult:
    gaps_ms = sorted(g * 1e3 for g in gaps)
    p99 = gaps_ms[min(len(gaps_ms) - 1, int(0.99 * len(gaps_ms)))]
    return LoopResult(mode, tokens, seconds, statistics.median(gaps_ms), p99)


def main(args: argparse.Namespace) -> int:
    warn_if_loaded()
    args.output_dir = output_dir(args)
    if args.smoke:
        args.concurrency, args.max_tokens, args.num_kv_blocks, args.repeats = 2, 4, 64, 1
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    # Alternate the two modes so that neither always runs first (warm caches, clocks).
    runs: dict[str, list[LoopResult]] = {"thread": [], "process": []}
    for i in range(args.repeats):
        order = ["thread", "process"] if i % 2 == 0 else ["process", "thread"]
        for mode in order:
            run = _run_thread if mode == "thread" else _run_process
            runs[mode].append(asyncio.run(run(args, params)))
    # Per mode, the repetition with the median throughput.
    results = [sorted(rs, key=lambda r: r.tokens_per_s)[len(rs) // 2] for rs in runs.values()]
    header = f"{'mode':>8} {'tokens':>7} {'seconds':>8} {'tok/s':>7}"
    print(header + f" {'p50 ITL ms':>11} {'p99 ITL ms':>11}")
    for r in results:
        print(
            f"{r.mode:>8} {r.output_tokens:>7} {r.seconds:>8.2f} {r.tokens_per_s:>7.1f} "
            f"{r.median_itl_ms:>11.1f} {r.p99_itl_ms:>11.1f}"
        )
    thread, process = results
    print(f"thread / process throughput: {thread.tokens_per_s / process.tokens_per_s:.2f}")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / "engine_loop.json"
    path.write_text(
        json.dumps([r.__dict__ | {"tokens_per_s": r.tokens_per_s} for r in results], indent=2)
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    from benchmarks.cli_args import parse_args

    raise SystemExit(main(parse_args("engine_loop")))
