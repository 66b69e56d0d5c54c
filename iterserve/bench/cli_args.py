"""Flags of the ``iterserve bench`` subcommands, importable without torch or numpy.

Building the parser (``iterserve --help``) only imports this module; each subcommand imports
its own module (``iterserve.bench.roofline`` loads torch) when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from iterserve.workload.workloads import WORKLOADS

_SMOKE_DIR_HELP = "default: bench-results (smoke: .../smoke)"


def _main_of(module: str) -> Callable[[argparse.Namespace], int]:
    """``<module>.main``, imported when the subcommand runs."""

    def run(args: argparse.Namespace) -> int:
        return int(importlib.import_module(module).main(args))

    return run


def add_bench_parsers(sub: Any) -> None:
    """One subparser per benchmark on ``sub`` (the subparsers action of ``iterserve bench``)."""
    _add_decode(sub)
    _add_offline(sub)
    _add_engine_loop(sub)
    _add_serve(sub)
    _add_gate(sub)
    _add_messages(sub)
    _add_calibrate(sub)
    _add_fidelity(sub)
    _add_router(sub)
    _add_telemetry(sub)
    _add_overload(sub)
    _add_soak(sub)
    _add_gpu(sub)


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """``--model`` and ``--dtype`` of the benchmarks that load a model themselves."""
    p.add_argument("--model", default="default", help="model to load (as `generate --model`)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="serving dtype (auto = bfloat16)",
    )


def _add_decode(sub: Any) -> None:
    p = sub.add_parser(
        "decode", help="decode-iteration micro-benchmark vs linears and memory floor"
    )
    _add_model_flags(p)
    p.add_argument("--iters", type=int, default=10, help="timed repetitions per row (median)")
    p.add_argument(
        "--shapes",
        default="1x128,32x128,128x128,64x512",
        help="comma-separated BATCHxCONTEXT rows, e.g. 32x128,64x512",
    )
    p.add_argument("--output-dir", type=Path, default=None, help=_SMOKE_DIR_HELP)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 2 iterations (tests)")
    p.set_defaults(func=_main_of("iterserve.bench.roofline"))


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
    p.set_defaults(func=_main_of("iterserve.bench.offline"))


def _add_engine_loop(sub: Any) -> None:
    p = sub.add_parser("engine-loop", help="engine loop on a thread vs in a process")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--extra-us", type=float, default=0.0, help="extra Python work per output")
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--output-dir", type=Path, default=None, help=_SMOKE_DIR_HELP)
    p.add_argument("--repeats", type=int, default=3, help="runs per mode, alternating order")
    p.add_argument("--smoke", action="store_true", help="2 streams of 4 tokens (tests)")
    p.set_defaults(func=_main_of("benchmarks.engine_loop"))


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
    p.set_defaults(func=_main_of("iterserve.bench.serve"))


def _add_gate(sub: Any) -> None:
    p = sub.add_parser("gate", help="exit 1 when a candidate run regresses latency")
    p.add_argument("baseline", type=Path, help="JSON of `bench serve` (the reference)")
    p.add_argument("candidate", type=Path, help="JSON of `bench serve` (the change)")
    p.add_argument("--max-ttft-p99-regression", type=float, default=0.20)
    p.add_argument("--max-tpot-p50-regression", type=float, default=0.15)
    p.set_defaults(func=_main_of("iterserve.bench.gate"))


def _add_messages(sub: Any) -> None:
    p = sub.add_parser(
        "messages",
        help="engine -> client bytes and pickling per output token: deltas vs cumulative",
    )
    p.add_argument("--output-lens", default="16,256,2048", help="comma-separated output lengths")
    p.add_argument("--num-requests", type=int, default=8, help="requests in the batch")
    p.add_argument("--logprobs", action="store_true", help="requests ask for logprobs=1")
    p.add_argument("--output-dir", type=Path, default=None, help=_SMOKE_DIR_HELP)
    p.add_argument("--smoke", action="store_true", help="output lengths 16 and 64 (tests)")
    p.set_defaults(func=_main_of("benchmarks.messages"))


def _add_calibrate(sub: Any) -> None:
    p = sub.add_parser(
        "calibrate", help="time the real engine's iterations and fit a latency profile (sim)"
    )
    _add_model_flags(p)
    p.add_argument("--batch-sizes", default="1,4,16,64", help="decode cells: batch sizes")
    p.add_argument("--contexts", default="128,512,2048", help="decode cells: context tokens")
    p.add_argument("--chunk-sizes", default="32,128,512", help="prefill cells: chunk tokens")
    p.add_argument("--seed", type=int, default=0, help="prompts and the held-out split")
    p.add_argument("--out", type=Path, default=None, help="profile JSON (default: in the dir)")
    p.add_argument("--name", default=None, help="profile name (default: --out's stem)")
    p.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help="points, plot (and profile); default: bench-results[/smoke]/calibrate-<time>",
    )
    p.add_argument("--smoke", action="store_true", help="tiny grid, well under a minute (tests)")
    p.set_defaults(func=_main_of("iterserve.bench.calibrate"))


def _add_fidelity(sub: Any) -> None:
    p = sub.add_parser("fidelity", help="the simulator vs the real server on the same traces (sim)")
    p.add_argument("--profile", default="cpu-smollm2", help="profile calibrated on this machine")
    p.add_argument("--workloads", default="mixed,long-prompt", help="comma-separated")
    p.add_argument("--num-requests", type=int, default=48, help="requests per trace")
    p.add_argument("--max-output-len", type=int, default=256, help="clip output lengths")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8600, help="port of the real server it starts")
    p.add_argument(
        "--production", action="store_true", help="also the A100 production table (simulated)"
    )
    p.add_argument("--production-only", action="store_true", help="only the A100 table")
    p.add_argument("--production-requests", type=int, default=1024)
    p.add_argument("--output-dir", type=Path, default=Path("bench-results"))
    p.set_defaults(func=_main_of("iterserve.bench.fidelity"))


def _add_router(sub: Any) -> None:
    p = sub.add_parser(
        "router", help="the router's overhead, balance per policy and prefix affinity (sim)"
    )
    p.add_argument(
        "--parts", default="overhead,balance,affinity", help="comma-separated parts to run"
    )
    p.add_argument("--num-replicas", type=int, default=4, help="balance and affinity replicas")
    p.add_argument(
        "--simulate-speed", type=float, default=2.0, help="balance and affinity replicas' speed"
    )
    p.add_argument("--num-requests", type=int, default=300, help="balance and affinity requests")
    p.add_argument("--load-factor", type=float, default=1.0, help="x the burst capacity")
    p.add_argument("--prefix-groups", type=int, default=8, help="affinity: system prompts")
    p.add_argument("--overhead-requests", type=int, default=100, help="per path and run")
    p.add_argument("--repeats", type=int, default=2, help="overhead runs")
    p.add_argument(
        "--overhead-rate", type=float, default=4.0, help="overhead: Poisson req/s, both paths"
    )
    p.add_argument(
        "--tokenizer",
        default="char",
        help="char (~4 characters per token, no model files), default or a model directory",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base-port", type=int, default=8680, help="first replica; router after")
    p.add_argument("--output-dir", type=Path, default=None, help=_SMOKE_DIR_HELP)
    p.add_argument("--smoke", action="store_true", help="2 replicas, tiny workloads (tests)")
    p.set_defaults(func=_main_of("benchmarks.router"))


def _add_telemetry(sub: Any) -> None:
    p = sub.add_parser("telemetry", help="engine iterations/s with and without --telemetry-db")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32, help="max_num_seqs")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-kv-blocks", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5, help="runs per mode, alternating order")
    p.add_argument("--output-dir", type=Path, default=None, help=_SMOKE_DIR_HELP)
    p.add_argument("--smoke", action="store_true", help="4 requests of 4 tokens, 1 run (tests)")
    p.set_defaults(func=_main_of("benchmarks.telemetry"))


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    """The server under test of ``bench overload`` and ``bench soak``: one they start, or
    ``--url``."""
    p.add_argument(
        "--server-args",
        default="",
        help="flags of the `iterserve serve` it starts (default: none, the real default "
        "model), e.g. '--simulate cpu-smollm2'; the benchmark adds --tiers and --admin-token",
    )
    p.add_argument("--port", type=int, default=0, help="port of the started server (0: free)")
    p.add_argument("--url", default=None, help="attach to this running server instead")
    p.add_argument("--server-pid", type=int, default=None, help="with --url: its pid, for RSS")
    p.add_argument("--admin-token", default=None, help="with --url: for tiers and live changes")
    p.add_argument("--sample-interval", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--timeout-s", type=float, default=600.0, help="client timeout per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", type=Path, default=None, help=_SMOKE_DIR_HELP)


def _add_overload(sub: Any) -> None:
    p = sub.add_parser(
        "overload", help="open-loop load at 2x measured capacity: 429s, RSS, premium TTFT"
    )
    _add_server_flags(p)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of overload")
    p.add_argument("--load-factor", type=float, default=2.0, help="x the measured capacity")
    p.add_argument("--capacity-s", type=float, default=60.0, help="closed-loop capacity phase")
    p.add_argument("--baseline-s", type=float, default=60.0, help="open loop at 1x (0: skip)")
    p.add_argument(
        "--concurrency", type=int, default=None, help="capacity phase (default: max_num_seqs)"
    )
    p.add_argument("--tier-mix", default="premium=0.2,standard=0.5,best-effort=0.3")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    p.add_argument("--max-rss-growth-mib", type=float, default=256.0, help="bound on RSS growth")
    p.add_argument("--premium-tier", default="premium", help="tier whose TTFT target is checked")
    p.add_argument("--smoke", action="store_true", help="a few seconds per phase (tests)")
    p.set_defaults(func=_main_of("benchmarks.overload"))


def _add_soak(sub: Any) -> None:
    p = sub.add_parser(
        "soak", help="long mixed traffic with live config changes: leaks, RSS, stuck requests"
    )
    _add_server_flags(p)
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic")
    p.add_argument("--config-interval", type=float, default=60.0, help="seconds between PUTs")
    p.add_argument("--request-rate", type=float, default=3.0, help="Poisson req/s")
    p.add_argument(
        "--warmup-s",
        type=float,
        default=None,
        help="RSS reference after this (default: one pass through the config cycle)",
    )
    p.add_argument("--max-rss-growth-mib", type=float, default=64.0, help="bound after warm-up")
    p.add_argument(
        "--drain-timeout-s", type=float, default=120.0, help="after the traffic: to end and idle"
    )
    p.add_argument("--smoke", action="store_true", help="6.5 s, a change every 0.8 s (tests)")
    p.set_defaults(func=_main_of("benchmarks.soak"))


def _add_gpu(sub: Any) -> None:
    p = sub.add_parser(
        "gpu", help="the prepared GPU check: kernels, attention bandwidth, 8B offline, parity"
    )
    add_gpu_args(p)
    p.set_defaults(func=_main_of("benchmarks.gpu"))


def add_gpu_args(p: argparse.ArgumentParser) -> None:
    """Flags of ``iterserve bench gpu`` (also ``python -m benchmarks.gpu``). Shape flags
    left unset take the full run's values, or ``--quick``'s."""
    p.add_argument("--device", default="cuda", help="cuda (default), or cpu for tests")
    p.add_argument("--quick", action="store_true", help="fewer shapes and requests, 8 layers")
    p.add_argument("--sections", default="1,2,3,4,5", help="which sections to run, e.g. 1,2")
    p.add_argument("--output-dir", type=Path, default=Path("bench-results"))
    p.add_argument(
        "--attention-backend", default="auto", help="iterserve's backend on the device (auto)"
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="iterserve without decode CUDA graphs (as `serve --enforce-eager`)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument(
        "--attention-shapes",
        default=None,
        help="BATCHxCONTEXT decode shapes (default 64x2048,64x8192,256x2048,256x8192)",
    )
    p.add_argument(
        "--attention-geometry", default="32:8:128", help="HEADS:KV_HEADS:HEAD_DIM (32:8:128)"
    )
    p.add_argument(
        "--llama-shape",
        default="4096:32:32:8:14336:128256",
        help="HIDDEN:LAYERS:HEADS:KV_HEADS:INTERMEDIATE:VOCAB (Llama-3-8B)",
    )
    p.add_argument("--num-layers", type=int, default=None, help="override (quick: 8)")
    p.add_argument("--num-requests", type=int, default=None, help="section 3 (128; quick 64)")
    p.add_argument("--prompt-len", type=int, default=None, help="section 3 (256; quick 128)")
    p.add_argument("--output-len", type=int, default=None, help="section 3 (128; quick 64)")
    p.add_argument("--hf-timeout-s", type=float, default=None, help="section 3 (90; quick 25)")
    p.add_argument("--decode-batch", type=int, default=64, help="section 4 (64)")
    p.add_argument("--decode-context", type=int, default=None, help="section 4 (1024; quick 512)")
    p.add_argument("--decode-steps", type=int, default=None, help="section 4 (32; quick 16)")
    p.add_argument("--parity-requests", type=int, default=12, help="section 5 (12)")
    p.add_argument("--parity-tokens", type=int, default=None, help="section 5 (24; quick 16)")
    p.add_argument("--copy-mib", type=int, default=1024, help="size of the copy measured")
