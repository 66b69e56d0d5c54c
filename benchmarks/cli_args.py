"""Flags of the benchmarks in this folder (``python -m benchmarks.<name>`` from the
repository root), importable without torch or numpy."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

from iterserve.bench.cli_args import add_model_flags

SMOKE_DIR_HELP = "default: bench-results (smoke: .../smoke)"


def parse_args(name: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags of benchmark ``name`` (a module of this folder, e.g. ``engine_loop``) parsed
    from ``argv`` (default: ``sys.argv[1:]``). Raises SystemExit on bad flags, as argparse."""
    return parser(name).parse_args(argv)


def parser(name: str) -> argparse.ArgumentParser:
    """The parser of ``python -m benchmarks.<name>``; KeyError for an unknown ``name``."""
    description, add_args = BENCHMARKS[name]
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=description)
    add_args(p)
    return p


def add_decode_args(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    p.add_argument("--iters", type=int, default=10, help="timed repetitions per row (median)")
    p.add_argument(
        "--quantization", default="none", choices=["none", "int8", "q4"], help="as `serve`'s"
    )
    p.add_argument(
        "--shapes",
        default="1x128,32x128,128x128,64x512",
        help="comma-separated BATCHxCONTEXT rows, e.g. 32x128,64x512",
    )
    p.add_argument("--output-dir", type=Path, default=None, help=SMOKE_DIR_HELP)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 2 iterations (tests)")


def add_engine_loop_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--extra-us", type=float, default=0.0, help="extra Python work per output")
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--output-dir", type=Path, default=None, help=SMOKE_DIR_HELP)
    p.add_argument("--repeats", type=int, default=3, help="runs per mode, alternating order")
    p.add_argument("--smoke", action="store_true", help="2 streams of 4 tokens (tests)")


def add_messages_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output-lens", default="16,256,2048", help="comma-separated output lengths")
    p.add_argument("--num-requests", type=int, default=8, help="requests in the batch")
    p.add_argument("--logprobs", action="store_true", help="requests ask for logprobs=1")
    p.add_argument("--output-dir", type=Path, default=None, help=SMOKE_DIR_HELP)
    p.add_argument("--smoke", action="store_true", help="output lengths 16 and 64 (tests)")


def add_router_args(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--output-dir", type=Path, default=None, help=SMOKE_DIR_HELP)
    p.add_argument("--smoke", action="store_true", help="2 replicas, tiny workloads (tests)")


def add_router_kv_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-replicas", type=int, default=4, help="on 127.0.0.2 and up")
    p.add_argument("--simulate-speed", type=float, default=2.0, help="the replicas' speed")
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--num-prefixes", type=int, default=16, help="distinct 500-token system prompts")
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=500,
        help="each replica's KV pool in 16-token blocks (0: the profile's, 2912)",
    )
    p.add_argument("--load-factor", type=float, default=1.0, help="x the burst capacity")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base-port", type=int, default=8700, help="the replicas' and the router's")
    p.add_argument("--kv-events-port", type=int, default=8701, help="every replica's")
    p.add_argument("--output-dir", type=Path, default=None, help=SMOKE_DIR_HELP)
    p.add_argument(
        "--smoke", action="store_true", help="2 replicas, 10 requests, 2 prefixes (tests)"
    )


def add_telemetry_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32, help="max_num_seqs")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-kv-blocks", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5, help="runs per mode, alternating order")
    p.add_argument("--output-dir", type=Path, default=None, help=SMOKE_DIR_HELP)
    p.add_argument("--smoke", action="store_true", help="4 requests of 4 tokens, 1 run (tests)")


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    """The server under test of ``overload`` and ``soak``: one they start, or ``--url``."""
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
    p.add_argument("--output-dir", type=Path, default=None, help=SMOKE_DIR_HELP)


def add_overload_args(p: argparse.ArgumentParser) -> None:
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


def add_soak_args(p: argparse.ArgumentParser) -> None:
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


def add_gpu_args(p: argparse.ArgumentParser) -> None:
    """Flags of ``python -m benchmarks.gpu``. Shape flags
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


# module name -> (description, flags)
BENCHMARKS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "decode": ("decode-iteration micro-benchmark vs linears and memory floor", add_decode_args),
    "engine_loop": ("engine loop on a thread vs in a process", add_engine_loop_args),
    "messages": (
        "engine -> client bytes and pickling per output token: deltas vs cumulative",
        add_messages_args,
    ),
    "router": (
        "the router's overhead, balance per policy and prefix affinity (sim)",
        add_router_args,
    ),
    "router_kv": (
        "prefix-cache hits, TTFT and throughput: no affinity, hash affinity, KV events (sim)",
        add_router_kv_args,
    ),
    "telemetry": ("engine iterations/s with and without --telemetry-db", add_telemetry_args),
    "overload": (
        "open-loop load at 2x measured capacity: 429s, RSS, premium TTFT",
        add_overload_args,
    ),
    "soak": (
        "long mixed traffic with live config changes: leaks, RSS, stuck requests",
        add_soak_args,
    ),
    "gpu": (
        "the prepared GPU check: kernels, attention bandwidth, 8B offline, parity",
        add_gpu_args,
    ),
}
