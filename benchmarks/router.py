"""``python -m benchmarks.router``: what the router costs and what its policies buy.

Three parts in one run, over simulated replicas (``serve --simulate cpu-smollm2``) and routers
started as subprocesses (replicas on ``--base-port`` and up, the router on the next port):

- **overhead**: one replica at speed 1 with prefix caching off (every run computes the same
  work), the same requests sent directly and through a router, alternating which goes first,
  ``--repeats`` times: one at a time (TTFT on an idle replica) and as Poisson arrivals (each
  request's TTFT difference between the two paths; p50 and p99 TTFT and ITL), and the
  router's CPU seconds per request (``/proc`` utime + stime; its polling of the replica
  included, and the polling alone measured during direct runs).
- **balance**: ``--num-replicas`` replicas, the ``mixed`` workload as Poisson arrivals at
  ``--load-factor`` x the fleet's capacity (requests / duration of the same requests sent as
  one burst through :func:`~iterserve.sim.replay.replay`), under ``least_kv``,
  ``round_robin`` and ``random``: p99 TTFT, p50 TPOT, throughput, and the replay's p99 TTFT.
- **affinity**: ``--prefix-groups`` system prompts of 500 tokens, each request one of them
  plus a 50-200-token tail, at the same load factor, ``least_kv`` with and without prefix
  affinity: the replicas' prefix-cache hit rate (``iterserve_prefix_cache_hits_total`` over
  ``..._queries_total``, in prompt tokens) and TTFT.

Every balance and affinity run gets fresh replicas (empty prefix caches) and a fresh router,
over the same requests. Those parts run at ``--simulate-speed`` X and report profile time:
the client's wall seconds x X (throughput / X), which multiplies the HTTP fronts' own
milliseconds by X too (docs/simulator.md). Prompts are ~4-character pseudo-words the replicas'
tokenizer (no model files) counts exactly; ``--tokenizer default`` (or a directory) cuts real
text with that tokenizer and starts the replicas with it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any

from benchmarks.router_fleet import (
    Fleet,
    client_args,
    cpu_seconds,
    prefix_cache_totals,
    router_counts,
)
from benchmarks.router_report import format_affinity, format_balance, format_overhead, plot
from iterserve.bench.common import output_dir, warn_if_loaded
from iterserve.bench.serve import arrival_times, run_load
from iterserve.sim.profile import load_profile
from iterserve.sim.replay import replay
from iterserve.sim.replica import SimTokenizer
from iterserve.sim.tokenizer import CharTokenizer, FileTokenizer
from iterserve.workload.stats import SLO, RequestRecord, percentile, summarize
from iterserve.workload.workloads import BenchRequest, PromptCutter, make_workload

PARTS = ("overhead", "balance", "affinity")
BALANCE_POLICIES = ("least_kv", "round_robin", "random")
AFFINITY_RUNS = {"least_kv": [], "least_kv --no-prefix-affinity": ["--no-prefix-affinity"]}
PROFILE = "cpu-smollm2"
OVERHEAD_GOAL_MS = 2.0
# Overhead requests: one shape, so the only variance is where in an iteration they arrive.
OVERHEAD_PROMPT_LEN, OVERHEAD_OUTPUT_LEN = 128, 32
PREFIX_LEN = 500


def _smoke(args: argparse.Namespace) -> None:
    """Tiny sizes: the whole run in about 15 s (the test)."""
    args.num_replicas, args.simulate_speed, args.num_requests = 2, 10.0, 8
    args.overhead_requests, args.repeats, args.overhead_rate, args.prefix_groups = 6, 1, 10.0, 2


def _profile_time(records: list[RequestRecord], speed: float) -> list[RequestRecord]:
    """The client's wall-clock records in profile seconds (``speed`` x)."""

    def scale(s: float | None) -> float | None:
        return None if s is None else s * speed

    return [
        dataclasses.replace(
            r, ttft_s=scale(r.ttft_s), e2e_s=scale(r.e2e_s), itl_s=[g * speed for g in r.itl_s]
        )
        for r in records
    ]


def _with_arrivals(requests: list[BenchRequest], rate: float, seed: int) -> list[BenchRequest]:
    offsets = arrival_times(len(requests), rate, None, 0.0, seed)
    return [dataclasses.replace(r, arrival_s=o) for r, o in zip(requests, offsets, strict=True)]


def _burst_capacity(
    requests: list[BenchRequest],
    tokenizer: SimTokenizer,
    n: int,
    affinity: bool,
    engine_kwargs: dict[str, Any] | None = None,
) -> float:
    """Requests per profile second the fleet drains a burst of ``requests`` at (replay;
    ``engine_kwargs`` as the replicas' flags, e.g. ``num_kv_blocks``)."""
    profile = load_profile(PROFILE)
    result = replay(
        requests, profile, engine_kwargs or {}, tokenizer, n, "least_kv", prefix_affinity=affinity
    )
    return len(requests) / result.duration_s


def _headline(s: dict[str, Any]) -> dict[str, float]:
    return {
        "ttft_p50_ms": s["ttft_ms"]["p50"],
        "ttft_p99_ms": s["ttft_ms"]["p99"],
        "tpot_p50_ms": s["tpot_ms"]["p50"],
        "itl_p50_ms": s["itl_ms"]["p50"],
        "itl_p99_ms": s["itl_ms"]["p99"],
        "output_tokens_per_s": s["output_tokens_per_s"],
        "requests_per_s": s["requests_per_s"],
        "num_ok": s["num_ok"],
        "num_requests": s["num_requests"],
    }


def _sizes(args: argparse.Namespace) -> dict[str, Any]:
    """What the balance and affinity tables say about their runs."""
    return {
        "num_replicas": args.num_replicas,
        "simulate_speed": args.simulate_speed,
        "num_requests": args.num_requests,
        "load_factor": args.load_factor,
    }


def _load(
    url: str | list[str],
    requests: list[BenchRequest],
    model: str,
    seed: int,
    concurrency: int | None = None,
    targets: list[int] | None = None,
) -> tuple[list[RequestRecord], float, float]:
    """``requests`` at their ``arrival_s`` (wall seconds), or ``concurrency`` at a time, to
    ``url`` (or ``url[targets[i]]``): (records in order, wall seconds, client CPU seconds)."""
    args = client_args(seed, concurrency)
    return asyncio.run(run_load(url, requests, model, args, math.inf, targets))


# --------------------------------------------------------------------------- overhead


def overhead(args: argparse.Namespace, fleet: Fleet, cutter: PromptCutter) -> dict[str, Any]:
    """One replica at speed 1, direct vs through a router (see the module docstring).

    Two kinds of run per repeat. *Idle*: one request at a time (4 tokens out), once per path,
    alternating which goes first, so each meets an idle engine and its TTFT is the prefill
    plus the path, nothing else. *Loaded*: the same Poisson arrivals at ``--overhead-rate``
    (the simulated replica's iterations are deterministic, so a request meets nearly the same
    engine state both times), and the headline is each request's own TTFT difference between
    the two runs, its median: comparing the two runs' medians instead drowns a millisecond in
    the spread of TTFT (tens of ms between requests at 4 req/s). Open loop: a closed loop with
    several streams would hide the router, since each request then starts when the last
    one's final token arrives, just after an iteration began, and joins the next iteration
    whatever the path adds. The router's polling alone is measured during the direct runs
    (the router does nothing else then).
    """
    output_len = 4 if args.smoke else OVERHEAD_OUTPUT_LEN
    loaded = _with_arrivals(
        [
            BenchRequest(cutter.cut(OVERHEAD_PROMPT_LEN), OVERHEAD_PROMPT_LEN, output_len)
            for _ in range(args.overhead_requests)
        ],
        args.overhead_rate,
        args.seed,
    )
    idle = [BenchRequest(r.prompt, r.prompt_len, 4) for r in loaded[: args.overhead_requests // 2]]
    modes = ("direct", "router")
    records: dict[str, list[RequestRecord]] = {m: [] for m in modes}
    idle_ttft: dict[str, list[float]] = {m: [] for m in modes}
    paired: list[float] = []  # a request's TTFT through the router - directly, ms
    cpu, wall = dict.fromkeys(modes, 0.0), dict.fromkeys(modes, 0.0)
    runs: list[dict[str, Any]] = []  # each loaded run's own percentiles: the noise between runs
    with fleet.running(1, [], speed=1.0, replica_flags=["--no-enable-prefix-caching"]) as f:
        urls = {"direct": f.replica_urls[0], "router": f.router_url}
        for repeat in range(args.repeats):
            mine: dict[str, list[RequestRecord]] = {}
            for mode in modes if repeat % 2 == 0 else modes[::-1]:
                recs, _, _ = _load(urls[mode], idle, f.model, args.seed, concurrency=1)
                idle_ttft[mode] += [r.ttft_s * 1000 for r in recs if r.ttft_s is not None]
                cpu0 = cpu_seconds(f.router_pid)
                recs, seconds, _ = _load(urls[mode], loaded, f.model, args.seed)
                cpu[mode] += cpu_seconds(f.router_pid) - cpu0
                wall[mode] += seconds
                records[mode] += recs
                mine[mode] = recs
                runs.append(
                    {"mode": mode, "repeat": repeat, **_headline(summarize(recs, seconds, SLO()))}
                )
            for direct, routed in zip(mine["direct"], mine["router"], strict=True):
                if direct.ttft_s is not None and routed.ttft_s is not None:
                    paired.append((routed.ttft_s - direct.ttft_s) * 1000)
    summaries = {m: _headline(summarize(r, wall[m], SLO())) for m, r in records.items()}
    for m in summaries:
        summaries[m]["idle_ttft_p50_ms"] = percentile(idle_ttft[m], 50)
    keys = ("idle_ttft_p50_ms", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
    added = {k: summaries["router"][k] - summaries["direct"][k] for k in keys}
    added["paired_ttft_p50_ms"] = percentile(paired, 50)
    added["paired_ttft_p90_ms"] = percentile(paired, 90)
    poll_fraction = cpu["direct"] / max(wall["direct"], 1e-9)
    num_routed = len(records["router"])
    return {
        "profile": PROFILE,
        "num_requests": args.overhead_requests,
        "num_idle_requests": len(idle),
        "repeats": args.repeats,
        "rate_rps": args.overhead_rate,
        "prompt_len": OVERHEAD_PROMPT_LEN,
        "output_len": output_len,
        "direct": summaries["direct"],
        "router": summaries["router"],
        "added_ms": added,
        "router_cpu_s_per_request": cpu["router"] / max(1, num_routed),
        "router_proxy_cpu_s_per_request": (cpu["router"] - poll_fraction * wall["router"])
        / max(1, num_routed),
        "router_poll_cpu_fraction": poll_fraction,
        "goal_ttft_p50_ms": OVERHEAD_GOAL_MS,
        "goal_met": added["paired_ttft_p50_ms"] < OVERHEAD_GOAL_MS,
        "runs": runs,
    }


# --------------------------------------------------------------------------- balance, affinity


def _policy_runs(
    args: argparse.Namespace,
    fleet: Fleet,
    trace: list[BenchRequest],
    runs: dict[str, list[str]],
) -> dict[str, dict[str, Any]]:
    """``trace`` (arrivals in profile seconds) through fresh replicas and a fresh router per
    entry of ``runs`` (name -> router flags); profile-time headlines and prefix-cache hits."""
    speed = args.simulate_speed
    wall_trace = [dataclasses.replace(r, arrival_s=(r.arrival_s or 0.0) / speed) for r in trace]
    out = {}
    for name, flags in runs.items():
        with fleet.running(args.num_replicas, flags, speed=speed) as f:
            before = [prefix_cache_totals(u) for u in f.replica_urls]
            records, wall, _ = _load(f.router_url, wall_trace, f.model, args.seed)
            after = [prefix_cache_totals(u) for u in f.replica_urls]
            counts = router_counts(f.router_url)
        run: dict[str, Any] = _headline(
            summarize(_profile_time(records, speed), wall * speed, SLO())
        )
        run.update(counts, load_average=os.getloadavg()[0])
        hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
        queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
        run["prefix_hit_rate"] = hits / queries if queries else 0.0
        out[name] = run
        print(
            f"  {name}: {wall:.1f} s, requests per replica "
            f"{sorted(int(v) for v in counts['requests_per_replica'].values())}, picks "
            f"{ {k: int(v) for k, v in counts['picks_by_reason'].items() if v} }",
            flush=True,
        )
    return out


def balance(args: argparse.Namespace, fleet: Fleet, tokenizer: SimTokenizer) -> dict[str, Any]:
    requests = make_workload(
        "mixed", tokenizer, args.num_requests, args.seed, 8 if args.smoke else 512
    )
    capacity = _burst_capacity(requests, tokenizer, args.num_replicas, affinity=True)
    rate = args.load_factor * capacity
    trace = _with_arrivals(requests, rate, args.seed)
    policies = _policy_runs(args, fleet, trace, {p: ["--policy", p] for p in BALANCE_POLICIES})
    profile = load_profile(PROFILE)
    for policy, run in policies.items():
        sim = replay(trace, profile, {}, tokenizer, args.num_replicas, policy, seed=args.seed)
        run["simulated_ttft_p99_ms"] = summarize(sim.records, sim.duration_s, SLO())["ttft_ms"][
            "p99"
        ]
    return {**_sizes(args), "capacity_rps": capacity, "rate_rps": rate, "policies": policies}


def prefix_groups_workload(
    cutter: PromptCutter, rng: random.Random, num_requests: int, num_groups: int, max_output: int
) -> list[BenchRequest]:
    """``num_groups`` system prompts of 500 tokens; each request one of them (at random) plus
    a 50-200-token tail, 16-``max_output`` tokens out."""
    prefixes = [cutter.cut(PREFIX_LEN) for _ in range(num_groups)]
    requests = []
    for _ in range(num_requests):
        tail_len = rng.randint(50, 200)
        prompt = rng.choice(prefixes) + "\n\n" + cutter.cut(tail_len)
        output_len = rng.randint(min(16, max_output), max_output)
        requests.append(BenchRequest(prompt, PREFIX_LEN + tail_len, output_len))
    return requests


def affinity(args: argparse.Namespace, fleet: Fleet, tokenizer: SimTokenizer) -> dict[str, Any]:
    rng = random.Random(args.seed + 7)
    cutter = PromptCutter(tokenizer, rng)
    requests = prefix_groups_workload(
        cutter, rng, args.num_requests, args.prefix_groups, 8 if args.smoke else 128
    )
    capacity = _burst_capacity(requests, tokenizer, args.num_replicas, affinity=False)
    rate = args.load_factor * capacity
    trace = _with_arrivals(requests, rate, args.seed)
    return {
        **_sizes(args),
        "capacity_rps": capacity,
        "rate_rps": rate,
        "num_groups": args.prefix_groups,
        "prefix_len": PREFIX_LEN,
        "runs": _policy_runs(args, fleet, trace, AFFINITY_RUNS),
    }


# --------------------------------------------------------------------------- main


def _tokenizer(name: str) -> tuple[SimTokenizer, list[str]]:
    """The prompts' tokenizer and the replicas' flags that make them count the same."""
    if name == "char":
        return CharTokenizer(load_profile(PROFILE).model.vocab_size), []
    from iterserve.models.loader import resolve_model_dir

    model_dir = resolve_model_dir(name)
    return FileTokenizer(model_dir), ["--model", str(model_dir)]


def main(args: argparse.Namespace) -> int:
    if args.smoke:
        _smoke(args)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        print(f"benchmarks.router: error: --parts must name some of {PARTS}, got {unknown}")
        return 2
    warn_if_loaded()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = output_dir(args) / f"router-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, replica_flags = _tokenizer(args.tokenizer)
    fleet = Fleet(args.base_port, replica_flags, out_dir / "logs", PROFILE)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    }
    result["settings"].pop("func", None)
    if "overhead" in parts:
        result["overhead"] = overhead(
            args, fleet, PromptCutter(tokenizer, random.Random(args.seed))
        )
        print(format_overhead(result["overhead"]), flush=True)
    if "balance" in parts:
        result["balance"] = balance(args, fleet, tokenizer)
        print(format_balance(result["balance"]), flush=True)
    if "affinity" in parts:
        result["affinity"] = affinity(args, fleet, tokenizer)
        print(format_affinity(result["affinity"]), flush=True)
    result["wall_s"] = time.perf_counter() - started
    json_path = out_dir / "router.json"
    json_path.write_text(json.dumps(result, indent=2))
    png = plot(result, out_dir / "router.png")
    print(f"wrote {json_path} and {png} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    from benchmarks.cli_args import parse_args

    raise SystemExit(main(parse_args("router")))
