"""What crosses the engine-process boundary per output token: deltas vs cumulative outputs.

The engine sends one :class:`~iterserve.engine.messages.StepResult` per iteration; since the
engine-boundary change each request's part is a delta (the new token, its text and logprobs).
The baseline, in the same run, is the message the engine used to send: every request's whole
:class:`~iterserve.engine.outputs.RequestOutput` so far (text, token ids, logprobs, prompt),
rebuilt here with an ``OutputAccumulator`` from the same deltas. For each output length the
script runs a batch of requests through the real ``LLMEngine`` (scheduler, detokenizer, stop
checks) on a runner that samples fixed words (no model: only the messages are measured), and
times ``pickle.dumps`` + ``pickle.loads`` of every iteration's message, as the pipe does.

Run: ``python -m benchmarks.messages``. Prints a table, writes ``messages.json`` and a plot.
"""

from __future__ import annotations

import argparse
import json
import pickle
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from iterserve.bench.common import output_dir, warn_if_loaded
from iterserve.config import EngineConfig
from iterserve.engine.factory import ModelInfo, build_engine
from iterserve.engine.messages import AddRequest, StepResult
from iterserve.engine.outputs import (
    ModelRunnerOutput,
    OutputAccumulator,
    SchedulerOutput,
    TokenLogprobs,
)
from iterserve.engine.sampling_params import SamplingParams

SENTENCE = "The quick brown fox jumps over the lazy dog while the band plays on. "


class WordRunner:
    """Samples the tokens of :data:`SENTENCE` in turn (with logprobs when asked)."""

    def __init__(self, token_ids: list[int], logprobs: bool) -> None:
        self.token_ids = token_ids
        self.logprobs = logprobs

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        sampled, logprobs = {}, {}
        for s in scheduler_output.scheduled:
            if s.sample:
                token_id = self.token_ids[s.seq_len % len(self.token_ids)]
                sampled[s.request_id] = token_id
                if self.logprobs:
                    logprobs[s.request_id] = TokenLogprobs(token_id, -0.5, [(token_id, -0.5)])
        return ModelRunnerOutput(sampled, logprobs)


@dataclass
class MessageRow:
    output_len: int
    num_requests: int
    num_tokens: int
    delta_bytes_per_token: float
    cumulative_bytes_per_token: float
    delta_us_per_token: float
    cumulative_us_per_token: float

    @property
    def bytes_ratio(self) -> float:
        return self.cumulative_bytes_per_token / self.delta_bytes_per_token

    @property
    def time_ratio(self) -> float:
        return self.cumulative_us_per_token / self.delta_us_per_token


def _round_trip_s(message: Any) -> tuple[int, float]:
    start = time.perf_counter()
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    pickle.loads(data)
    return len(data), time.perf_counter() - start


def measure(tokenizer: Any, output_len: int, num_requests: int, logprobs: bool) -> MessageRow:
    """Run ``num_requests`` requests of ``output_len`` tokens; bytes and µs per token."""
    words = list(tokenizer(SENTENCE, add_special_tokens=False).input_ids)
    prompt = list(tokenizer(SENTENCE * 4).input_ids)
    max_model_len = len(prompt) + output_len
    num_blocks = num_requests * (max_model_len // 16 + 1)
    config = EngineConfig.from_kwargs(
        max_model_len=max_model_len,
        num_kv_blocks=num_blocks,
        max_num_seqs=num_requests,
        max_num_batched_tokens=max(2048, num_requests),
    )
    runner = WordRunner(words, logprobs)
    engine = build_engine(
        config, runner, tokenizer, ModelInfo(len(tokenizer), frozenset(), num_blocks)
    )
    params = SamplingParams(
        max_tokens=output_len, ignore_eos=True, logprobs=1 if logprobs else None
    )
    accumulators = {}
    prompt_text = SENTENCE * 4
    for i in range(num_requests):
        request_id = f"{i}:cmpl-{i:032x}"
        engine.add(AddRequest(request_id, prompt, params, 1, 0.0))
        accumulators[request_id] = OutputAccumulator(request_id, prompt_text, prompt, 1, logprobs)
    delta_bytes = cumulative_bytes = 0
    delta_s = cumulative_s = 0.0
    num_tokens = 0
    while engine.has_unfinished_requests():
        deltas = engine.step_deltas()
        load, telemetry = engine.load(), engine.telemetry_since(engine.num_iterations - 1)
        outputs = [accumulators[d.request_id].add(d) for d in deltas]
        num_tokens += sum(len(c.new_token_ids) for d in deltas for c in d.completions)
        n, s = _round_trip_s(StepResult(deltas, load, telemetry))
        delta_bytes, delta_s = delta_bytes + n, delta_s + s
        # What the engine sent before: ("outputs", cumulative outputs, telemetry, counts).
        n, s = _round_trip_s(("outputs", outputs, telemetry, asdict(load)))
        cumulative_bytes, cumulative_s = cumulative_bytes + n, cumulative_s + s
    return MessageRow(
        output_len,
        num_requests,
        num_tokens,
        delta_bytes / num_tokens,
        cumulative_bytes / num_tokens,
        delta_s / num_tokens * 1e6,
        cumulative_s / num_tokens * 1e6,
    )


def format_table(rows: list[MessageRow]) -> str:
    lines = [
        f"{'output':>7} {'reqs':>5} {'B/token':>9} {'B/token':>10} {'x':>6} "
        f"{'us/token':>9} {'us/token':>10} {'x':>6}",
        f"{'tokens':>7} {'':>5} {'deltas':>9} {'cumulative':>10} {'':>6} "
        f"{'deltas':>9} {'cumulative':>10} {'':>6}",
    ]
    for r in rows:
        lines.append(
            f"{r.output_len:>7} {r.num_requests:>5} {r.delta_bytes_per_token:>9.1f} "
            f"{r.cumulative_bytes_per_token:>10.1f} {r.bytes_ratio:>6.1f} "
            f"{r.delta_us_per_token:>9.2f} {r.cumulative_us_per_token:>10.2f} "
            f"{r.time_ratio:>6.1f}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from iterserve.models.loader import resolve_model_dir

    warn_if_loaded()
    out_dir = output_dir(args)
    lengths = [16, 64] if args.smoke else [int(x) for x in args.output_lens.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir("default")))
    rows = [measure(tokenizer, n, args.num_requests, args.logprobs) for n in lengths]
    print(f"engine -> client messages, {args.num_requests} requests at once, pickle round trip")
    print(format_table(rows))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "messages.json"
    path.write_text(
        json.dumps(
            {
                "num_requests": args.num_requests,
                "logprobs": args.logprobs,
                "rows": [asdict(r) for r in rows],
            },
            indent=2,
        )
    )
    png = _plot(rows, path.with_suffix(".png"))
    print(f"wrote {path} and {png}")
    return 0


def _plot(rows: list[MessageRow], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    x = [r.output_len for r in rows]
    for ax, field, label in (
        (left, "bytes_per_token", "bytes per output token"),
        (right, "us_per_token", "pickle round trip, µs per output token"),
    ):
        ax.plot(x, [getattr(r, f"delta_{field}") for r in rows], "o-", label="deltas (now)")
        ax.plot(x, [getattr(r, f"cumulative_{field}") for r in rows], "s--", label="cumulative")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("output tokens per request")
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


if __name__ == "__main__":
    from benchmarks.cli_args import parse_args

    raise SystemExit(main(parse_args("messages")))
