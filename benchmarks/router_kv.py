"""``python -m benchmarks.router_kv``: what placing prompts by the replicas' KV events buys.

``--num-replicas`` simulated replicas (``serve --simulate cpu-smollm2``: the real scheduler and
block manager, so prefix caching is real) on ``127.0.0.2`` and up, all publishing KV events on
one ``--kv-events-port``, each with a KV pool of ``--num-kv-blocks``, and a router in front;
the ``shared-prefix`` workload (``--num-prefixes`` 500-token system prompts, each request one
of them drawn uniformly plus a 50-200-token tail; ``iterserve.workload``) as Poisson arrivals
at ``--load-factor`` x the fleet's burst capacity (as ``benchmarks.router``'s affinity part).

Decision: 16 prefixes (~31 blocks each) over 4 replicas of 500 blocks by default. A replica
cannot keep every prefix cached beside its running requests' blocks, so where a prefix's
requests go decides the hits: spread over all four replicas (no affinity), each replica
evicts prefixes it will see again; kept on few (hash, events), each holds its own. With one
prefix (``--num-prefixes 1``, the workload's default) every replica holds it after its first
request and all three runs hit alike.

Three runs over the same requests, each with fresh replicas (empty caches) and a fresh router:

- **no affinity**: ``least_kv`` alone (``--no-prefix-affinity``);
- **hash affinity**: the prefix key's two replicas on the ring, bounded loads (the default);
- **KV events**: the router subscribes to the replicas' events (``--kv-events-port``,
  ``--tokenizer char:49152``, the replicas' own ~4-characters-per-token tokenizer) and sends
  each prompt to the replica holding most of its leading blocks, under the load bound.

Reported per run: the replicas' prefix-cache hit rate (``iterserve_prefix_cache_hits_total`` /
``..._queries_total``, prompt tokens), TTFT p50 / p99 and output tokens/s in profile time, and
the router's picks per reason. Table printed; JSON and PNG under ``--output-dir``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from benchmarks.router import (
    PROFILE,
    _burst_capacity,
    _policy_runs,
    _sizes,
    _with_arrivals,
)
from benchmarks.router_fleet import Fleet
from benchmarks.router_report import format_policies
from iterserve.bench.common import output_dir, warn_if_loaded
from iterserve.sim.profile import load_profile
from iterserve.sim.tokenizer import CharTokenizer
from iterserve.workload.workloads import BenchRequest, make_workload


def runs(events_port: int, vocab_size: int) -> dict[str, list[str]]:
    """Run name -> the router's flags."""
    kv = ["--kv-events-port", str(events_port), "--tokenizer", f"char:{vocab_size}"]
    return {"no affinity": ["--no-prefix-affinity"], "hash affinity": [], "KV events": kv}


def _smoke(args: argparse.Namespace) -> None:
    """Tiny sizes: the whole run in about 9 s (the test)."""
    args.num_replicas, args.simulate_speed, args.num_requests = 2, 10.0, 10
    args.num_prefixes = 2


def check_args(args: argparse.Namespace, requests: list[BenchRequest]) -> str | None:
    """What is wrong with the flags, given the workload's ``requests`` (None: nothing)."""
    if args.num_replicas < 1 or args.num_requests < 1:
        return "--num-replicas and --num-requests must be >= 1"
    if args.num_kv_blocks < 0:
        return f"--num-kv-blocks must be >= 0 (0: the profile's pool), got {args.num_kv_blocks}"
    block_size = load_profile(PROFILE).kv_cache.block_size
    most = max(-(-(r.prompt_len + r.output_len) // block_size) for r in requests)
    if 0 < args.num_kv_blocks < most:
        return f"--num-kv-blocks {args.num_kv_blocks} < {most}, the longest request's blocks"
    return None


def plot(result: dict[str, Any], path: Path) -> Path:
    """Hit rate, TTFT p50 / p99 and throughput per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs_ = result["runs"]
    panels = [
        ("prefix-cache hits", {k: 100 * v["prefix_hit_rate"] for k, v in runs_.items()}, "%"),
        ("TTFT p50", {k: v["ttft_p50_ms"] for k, v in runs_.items()}, "ms"),
        ("TTFT p99", {k: v["ttft_p99_ms"] for k, v in runs_.items()}, "ms"),
        ("throughput", {k: v["output_tokens_per_s"] for k, v in runs_.items()}, "output tok/s"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.5 * len(panels), 3.5), squeeze=False)
    for ax, (title, values, unit) in zip(axes[0], panels, strict=True):
        ax.bar(range(len(values)), list(values.values()), color="tab:blue")
        ax.set_xticks(range(len(values)), list(values), fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(unit)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(args: argparse.Namespace) -> int:
    if args.smoke:
        _smoke(args)
    warn_if_loaded()
    vocab_size = load_profile(PROFILE).model.vocab_size
    tokenizer = CharTokenizer(vocab_size)
    started = time.perf_counter()
    try:
        requests = make_workload(
            "shared-prefix",
            tokenizer,
            args.num_requests,
            args.seed,
            8 if args.smoke else 128,
            num_prefixes=args.num_prefixes,
        )
    except ValueError as e:
        print(f"benchmarks.router_kv: error: {e}")
        return 2
    error = check_args(args, requests)
    if error:
        print(f"benchmarks.router_kv: error: {error}")
        return 2
    out_dir = output_dir(args) / f"router-kv-{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir.mkdir(parents=True, exist_ok=True)
    pool = {"num_kv_blocks": args.num_kv_blocks} if args.num_kv_blocks else {}
    replica_flags = ["--kv-events-port", str(args.kv_events_port)]
    replica_flags += ["--num-kv-blocks", str(args.num_kv_blocks)] if pool else []
    fleet = Fleet(args.base_port, replica_flags, out_dir / "logs", PROFILE, loopback_hosts=True)
    random.Random(args.seed).shuffle(requests)
    capacity = _burst_capacity(requests, tokenizer, args.num_replicas, False, pool)
    rate = args.load_factor * capacity
    trace = _with_arrivals(requests, rate, args.seed)
    result: dict[str, Any] = {
        **_sizes(args),
        "workload": "shared-prefix",
        "num_prefixes": args.num_prefixes,
        "num_kv_blocks": args.num_kv_blocks or load_profile(PROFILE).kv_cache.num_blocks,
        "capacity_rps": capacity,
        "rate_rps": rate,
        "runs": _policy_runs(args, fleet, trace, runs(args.kv_events_port, vocab_size)),
    }
    result["wall_s"] = time.perf_counter() - started
    title = (
        f"KV-event placement: {args.num_replicas} replicas at speed {args.simulate_speed:g}, "
        f"shared-prefix ({args.num_prefixes} prefixes, {result['num_kv_blocks']} KV blocks "
        f"per replica), {args.num_requests} requests, Poisson {rate:.2f} req/s "
        f"({args.load_factor:g}x the burst capacity {capacity:.2f} req/s)"
    )
    print(format_policies(title, result["runs"], sim=False), flush=True)
    json_path = out_dir / "router_kv.json"
    json_path.write_text(json.dumps(result, indent=2))
    png = plot(result, out_dir / "router_kv.png")
    print(f"wrote {json_path} and {png} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    from benchmarks.cli_args import parse_args

    raise SystemExit(main(parse_args("router_kv")))
