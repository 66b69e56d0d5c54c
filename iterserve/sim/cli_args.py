"""Flags of ``iterserve simulate`` (argparse only: building the parser loads nothing else)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, required=True, help="JSONL trace (bench serve's format)")
    p.add_argument(
        "--profile",
        default="cpu-smollm2",
        help="latency profile: a JSON file, or cpu-smollm2 / a100x4-llama3-70b "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--config",
        type=Path,
        action="append",
        default=[],
        help="YAML of engine flags, one candidate per file (repeatable; none: the defaults)",
    )
    p.add_argument("--replicas", type=int, default=1, help="replicas behind the router")
    p.add_argument(
        "--routing",
        choices=("least_kv", "round_robin", "random"),
        default="least_kv",
        help="how requests are spread over replicas (default: %(default)s)",
    )
    p.add_argument(
        "--no-prefix-affinity",
        dest="prefix_affinity",
        action="store_false",
        help="least_kv without prefix affinity (as the router's flag)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="closed loop: keep this many requests in flight (trace timestamps ignored)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory for prompt text (default: ~4 characters per token)",
    )
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput (default: 2000)")
    p.add_argument("--slo-tpot-ms", type=float, default=200.0, help="goodput (default: 200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--json", type=Path, default=None, help="write the results here (the plot beside it)"
    )
    p.add_argument(
        "--output-dir",
        type=Path,
        default=Path("bench-results"),
        help="without --json: where the JSON and the plot go (default: %(default)s)",
    )
    p.add_argument("--no-plot", action="store_true")
