"""Flags of the ``iterserve bench`` subcommands, importable without torch or numpy.

Building the parser (``iterserve --help``) only imports this module; each subcommand imports
its own module (``iterserve.bench.offline`` loads torch) when it runs. The one-off studies
are not subcommands: they live in the repository's ``benchmarks/`` (``python -m
benchmarks.<name>``).
"""

from __future__ import annotations

import argparse
import importlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from iterserve.workload.workloads import WORKLOADS


def _main_of(module: str) -> Callable[[argparse.Namespace], int]:
    """``iterserve.bench.<module>.main``, imported when the subcommand runs."""

    def run(args: argparse.Namespace) -> int:
        return int(importlib.import_module(f"iterserve.bench.{module}").main(args))

    return run


def add_bench_parsers(sub: Any) -> None:
    """One subparser per benchmark on ``sub`` (the subparsers action of ``iterserve bench``)."""
    _add_offline(sub)
    _add_serve(sub)
    _add_gate(sub)
    _add_calibrate(sub)
    _add_fidelity(sub)
    _add_quantization(sub)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """``--model`` and ``--dtype`` of the benchmarks that load a model themselves."""
    p.add_argument("--model", default="default", help="model to load (as `generate --model`)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="serving dtype (auto = bfloat16)",
    )


def _add_offline(sub: Any) -> None:
    p = sub.add_parser("offline", help="iterserve vs Hugging Face baselines, one table")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=32, help="batch size of every row")
    p.add_argument("--rows", default="1,2,3,4,5", help="which rows to run, e.g. 1,3,4")
    p.add_argument("--no-roofline", action="store_true")
    p.add_argument("--smoke", action="store_true", help="8 short requests (tests)")
    p.add_argument("--output-dir", type=Path, default=Path("bench-results"))
    p.set_defaults(func=_main_of("offline"))


def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="online load generator against an OpenAI-compatible URL")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--workload", choices=WORKLOADS, default="mixed")
    p.add_argument("--trace", type=Path, default=None, help="JSONL trace to replay instead")
    p.add_argument("--save-trace", type=Path, default=None, help="write the workload as JSONL")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson req/s")
    p.add_argument("--burst", type=int, default=None, help="send groups of this many at once")
    p.add_argument("--burst-interval-s", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=None, help="closed loop: this many at once")
    p.add_argument("--sweep", default=None, help="comma-separated rates: find the best one")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument(
        "--slo-attainment", type=float, default=0.9, help="fraction meeting the SLO (sweep)"
    )
    p.add_argument("--tier-mix", default=None, help="e.g. premium=0.2,standard=0.5,best-effort=0.3")
    p.add_argument("--cost-per-hour", type=float, default=None, help="$/hour of the replica")
    p.add_argument("--plain", action="store_true", help="send only standard OpenAI fields")
    p.add_argument("--tokenizer", default="default", help="tokenizer dir for cutting prompts")
    p.add_argument("--label", default=None, help="name of this run in tables and plots")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--smoke", action="store_true", help="8 short requests: checks the pipeline")
    p.add_argument("--output-dir", type=Path, default=Path("bench-results"))
    p.set_defaults(func=_main_of("serve"))


def _add_gate(sub: Any) -> None:
    p = sub.add_parser("gate", help="exit 1 when a candidate run regresses latency")
    p.add_argument("baseline", type=Path, help="JSON of `bench serve` (the reference)")
    p.add_argument("candidate", type=Path, help="JSON of `bench serve` (the change)")
    p.add_argument("--max-ttft-p99-regression", type=float, default=0.20)
    p.add_argument("--max-tpot-p50-regression", type=float, default=0.15)
    p.set_defaults(func=_main_of("gate"))


def _add_calibrate(sub: Any) -> None:
    p = sub.add_parser(
        "calibrate", help="time the real engine's iterations and fit a latency profile (sim)"
    )
    add_model_flags(p)
    ints, tokens = _int_list(1), _int_list(2)  # a prefill needs two tokens or more
    p.add_argument("--batch-sizes", type=ints, default="1,4,16,64", help="decode cells: batches")
    p.add_argument("--contexts", type=ints, default="128,512,2048", help="decode cells: context")
    p.add_argument("--chunk-sizes", type=tokens, default="32,128,512", help="prefill cells: chunks")
    p.add_argument(
        "--arrival-lengths", type=tokens, default="64,256", help="arrival cells: prompt tokens"
    )
    p.add_argument("--seed", type=int, default=0, help="prompts and the held-out split")
    p.add_argument("--out", type=Path, default=None, help="profile JSON (default: in the dir)")
    p.add_argument("--name", default=None, help="profile name (default: --out's stem)")
    p.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help="points, plot (and profile); default: bench-results[/smoke]/calibrate-<time>",
    )
    p.add_argument(
        "--repeats",
        type=_positive_int,
        default=3,
        help="measured runs of each cell (after a warm-up)",
    )
    p.add_argument(
        "--max-held-out-error-pct",
        type=_positive_float,
        default=15.0,
        help="refuse the profile (exit 1) over this held-out median error, or a cell over twice it",
    )
    p.add_argument("--force", action="store_true", help="write a refused profile (with a warning)")
    p.add_argument(
        "--smoke", action="store_true", help="tiny grid and loads (tests; overrides the grid flags)"
    )
    p.add_argument(
        "--no-serve",
        action="store_true",
        help="skip the serve stage (a real server's HTTP side): the profile predicts the engine",
    )
    p.set_defaults(func=_main_of("calibrate"))


def _int_list(minimum: int) -> Any:
    """An argparse type: comma-separated integers >= ``minimum`` (empty: none), kept as text."""

    def parse(text: str) -> str:
        for item in (v.strip() for v in text.split(",")):
            if not item:
                continue
            try:
                value = int(item)
            except ValueError:
                raise argparse.ArgumentTypeError(f"not an integer: {item!r}") from None
            if value < minimum:
                raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return text

    return parse


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def _add_fidelity(sub: Any) -> None:
    p = sub.add_parser(
        "fidelity", help="the simulator vs the real server on traces it was not fitted on (sim)"
    )
    p.add_argument(
        "--shapes",
        default="all",
        help="comma-separated trace shapes: poisson-low, poisson-high, bursty, long-prompt, "
        "shared-prefix, tiers (default all)",
    )
    p.add_argument(
        "--repeat-real",
        type=int,
        default=2,
        help="real-server replays of each trace (a fresh server each): their spread",
    )
    p.add_argument(
        "--calibrate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="calibrate a profile first, in the same run (--no-calibrate: use --profile)",
    )
    p.add_argument(
        "--calibrate-args", default="", help="extra `bench calibrate` flags, e.g. '--smoke'"
    )
    p.add_argument("--profile", default=None, help="with --no-calibrate: profile name or JSON")
    p.add_argument("--num-requests", type=int, default=48, help="requests per trace")
    p.add_argument("--max-output-len", type=int, default=256, help="clip output lengths")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=0, help="real server's port (0: a free one)")
    p.add_argument(
        "--server-args",
        default="",
        help="extra `iterserve serve` flags of the real server, e.g. '--simulate cpu-smollm2' "
        "(the simulator does not see them: settings that change serving make the comparison "
        "unfair)",
    )
    p.add_argument(
        "--production", action="store_true", help="also the A100 production table (simulated)"
    )
    p.add_argument("--production-only", action="store_true", help="only the A100 table")
    p.add_argument("--production-requests", type=int, default=1024)
    p.add_argument("--output-dir", type=Path, default=Path("bench-results"))
    p.set_defaults(func=_main_of("fidelity"))


def _int_csv(value: str) -> list[int]:
    try:
        values = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas: {value!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1: {value!r}")
    return values


def _modes(value: str) -> list[str]:
    from iterserve.bench.common import quantization_mode

    modes = [v.strip() for v in value.split(",") if v.strip()]
    if not modes:
        raise argparse.ArgumentTypeError(f"no mode in {value!r} (bf16 always runs)")
    for mode in modes:
        try:
            quantization_mode(mode)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return modes


def _add_quantization(sub: Any) -> None:
    p = sub.add_parser(
        "quantization",
        help="--quantization modes vs bf16 and llama.cpp's llama-server: quality, online, offline",
    )
    p.add_argument(
        "--modes",
        type=_modes,
        default=["int8", "q4", "int8+kv8"],
        help="beside bf16: int8, q4 (weights), kv8 (int8 KV cache) or a weight mode +kv8 "
        "(default: int8,q4,int8+kv8)",
    )
    p.add_argument(
        "--concurrency", type=_int_csv, default=[1, 8, 32], help="streams (default: 1,8,32)"
    )
    p.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt (default 256)")
    p.add_argument("--output-len", type=int, default=128, help="tokens per request (default 128)")
    p.add_argument(
        "--min-requests", type=int, default=8, help="requests per run, at least 2 x c (default 8)"
    )
    p.add_argument("--offline-requests", type=int, default=64, help="offline (default 64)")
    p.add_argument(
        "--quality-prompts", type=int, default=32, help="greedy-agreement prompts (default 32)"
    )
    p.add_argument("--quality-tokens", type=int, default=32, help="tokens each (default 32)")
    p.add_argument(
        "--llama-server",
        default="auto",
        help="llama.cpp's server: a path, none, or auto (scripts/llama-server-build; default)",
    )
    p.add_argument("--no-quality", action="store_true", help="skip perplexity and agreement")
    p.add_argument("--no-offline", action="store_true", help="skip the LLM.generate rows")
    p.add_argument("--seed", type=int, default=0, help="prompt selection (default 0)")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="int8 at c=1, 2 short requests, no llama.cpp (overrides the sizing flags); "
        "writes under bench-results/smoke",
    )
    p.add_argument("--output-dir", type=Path, default=None, help="default: bench-results")
    p.set_defaults(func=_main_of("quantization"))
