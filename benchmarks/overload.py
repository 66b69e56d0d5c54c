"""``python -m benchmarks.overload``: open-loop load at 2x the measured capacity.

Three phases against one server, its RSS (process tree) and ``/load`` sampled throughout:

1. **capacity**: a closed loop of ``--concurrency`` streams (default: the server's
   ``max_num_seqs``) for ``--capacity-s``; capacity = requests completed per second from the
   first completion to the end of the phase (:func:`capacity_of`; give it several request
   durations);
2. **1x** (the in-run baseline): Poisson arrivals at the capacity for ``--baseline-s``;
3. **overload**: Poisson arrivals at ``--load-factor`` x the capacity for ``--duration``.

Every request has the same shape (``--prompt-len``, ``--output-len`` tokens, exact with
``ignore_eos``), a tier drawn from ``--tier-mix``, and is streamed. Between phases the
server is left to go idle.

Checks of the overload phase (exit 1 when one fails):

- the excess is answered 429 (some 429s), each with a ``Retry-After`` of whole seconds, and
  no other refusal (5xx, connection errors);
- every accepted request completes (all its tokens and a ``finish_reason``);
- RSS bounded: the phase's highest RSS minus the RSS at its start is at most
  ``--max-rss-growth-mib``;
- p99 TTFT of the admitted ``--premium-tier`` requests is within that tier's
  ``ttft_target_ms`` (read from ``GET /admin/scheduler_config``).

A server it starts gets :data:`~benchmarks.reliability.BENCH_TIERS` (premium: queue wait
at most 1 s, TTFT target 3 s; standard 4 s / 8 s; best-effort 8 s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

import httpx

from benchmarks.reliability import (
    Outcome,
    Prompts,
    RequestSpec,
    Sampler,
    Target,
    async_client,
    counts,
    model_name,
    scheduler_settings,
    send,
    server_under_test,
    wait_idle,
)
from benchmarks.reliability_report import check, format_checks, plot_timeline
from iterserve.bench.common import output_dir, warn_if_loaded
from iterserve.workload.stats import percentile

IDLE_TIMEOUT_S = 120.0


def _smoke(args: argparse.Namespace) -> None:
    args.capacity_s, args.baseline_s, args.duration, args.sample_interval = 2.0, 1.5, 3.0, 0.5
    args.prompt_len, args.output_len = 32, 32


def _tier_mix(mix: str) -> dict[str, float]:
    """``premium=0.2,standard=0.8`` as a mapping."""
    weights = {}
    for part in mix.split(","):
        name, _, weight = part.partition("=")
        weights[name.strip()] = float(weight or 1)
    return weights


class Workload:
    """Requests of one shape with seeded tiers and prompt offsets."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.prompts = Prompts()
        self.mix = _tier_mix(args.tier_mix)

    def next(self) -> RequestSpec:
        tier = self.rng.choices(list(self.mix), list(self.mix.values()))[0]
        prompt = self.prompts.cut(self.args.prompt_len, self.rng.randrange(1 << 30))
        return RequestSpec(prompt, self.args.output_len, tier)


async def closed_loop(
    http: httpx.AsyncClient,
    workload: Workload,
    model: str,
    concurrency: int,
    duration_s: float,
    t0: float,
) -> list[Outcome]:
    """``concurrency`` streams, each sending its next request when the last ends (after a
    429's ``Retry-After``, as a client should: retrying at once spins), until ``duration_s``
    (the requests open then are finished)."""
    end = time.perf_counter() + duration_s
    outcomes: list[Outcome] = []

    async def stream() -> None:
        while time.perf_counter() < end:
            outcome = await send(http, workload.next(), model, t0)
            outcomes.append(outcome)
            if outcome.status == 429 and (outcome.retry_after or "").isdigit():
                pause_s = min(float(outcome.retry_after or 0), end - time.perf_counter())
                await asyncio.sleep(max(0.0, pause_s))

    await asyncio.gather(*[stream() for _ in range(concurrency)])
    return outcomes


async def open_loop(
    http: httpx.AsyncClient,
    workload: Workload,
    model: str,
    rate: float,
    duration_s: float,
    t0: float,
) -> list[Outcome]:
    """Poisson arrivals at ``rate`` req/s for ``duration_s``; waits for every request."""
    start = time.perf_counter()
    tasks, next_s = [], 0.0
    while next_s < duration_s:
        await asyncio.sleep(max(0.0, start + next_s - time.perf_counter()))
        tasks.append(asyncio.create_task(send(http, workload.next(), model, t0)))
        next_s += workload.rng.expovariate(rate)
    return list(await asyncio.gather(*tasks))


def completed_per_s(outcomes: list[Outcome], start_s: float, end_s: float) -> float:
    """Requests completed within ``[start_s, end_s]`` (seconds from the run's start), per
    second."""
    ends = [o.end_s for o in outcomes if o.kind == "completed" and o.end_s is not None]
    return sum(start_s <= e <= end_s for e in ends) / max(end_s - start_s, 1e-9)


def capacity_of(outcomes: list[Outcome], start_s: float, sending_end_s: float) -> float:
    """A closed loop's steady rate: completions after the first one (the batch has turned
    over once: the fill-up and the server's first-request warm-up are behind) until the loop
    stopped sending, per second of that span; the whole phase's rate when too short."""
    ends = sorted(o.end_s for o in outcomes if o.kind == "completed" and o.end_s is not None)
    if not ends:
        return 0.0
    first = ends[0]
    steady = sum(first < e <= sending_end_s for e in ends)
    if steady == 0:
        return len(ends) / max(ends[-1] - start_s, 1e-9)
    return steady / (sending_end_s - first)


def phase_summary(
    outcomes: list[Outcome], samples: list[dict[str, Any]], phase: str, start_s: float, end_s: float
) -> dict[str, Any]:
    """Counts, TTFT per tier, throughput (completions within ``[start_s, end_s]``, seconds
    from the run's start) and RSS of one phase."""
    c = counts(outcomes)
    c["refused_otherwise"] = sum(not o.accepted and o.status != 429 for o in outcomes)
    ttft: dict[str, dict[str, float]] = {}
    for tier in sorted({o.tier for o in outcomes}):
        ms = [
            o.ttft_s * 1000
            for o in outcomes
            if o.tier == tier and o.kind == "completed" and o.ttft_s is not None
        ]
        ttft[tier] = {"n": len(ms), "p50": percentile(ms, 50), "p99": percentile(ms, 99)}
    rss = [s["rss_mib"] for s in samples if s["phase"] == phase]
    by_tier = {
        tier: {k: n for k, n in counts([o for o in outcomes if o.tier == tier]).items() if n}
        for tier in ttft
    }
    return {
        "counts": c,
        "counts_by_tier": by_tier,
        "rejected_share": c["rejected_429"] / max(1, c["sent"]),
        "completed_per_s": completed_per_s(outcomes, start_s, end_s),
        "ttft_ms": ttft,
        "rss_mib": {"start": rss[0], "max": max(rss), "end": rss[-1]} if rss else None,
    }


async def _phases(target: Target, model: str, args: argparse.Namespace) -> dict[str, Any]:
    load = httpx.get(target.url + "/load", timeout=10).json()
    concurrency = args.concurrency or int(load["max_num_seqs"])
    sampler = Sampler(target, args.sample_interval)
    t0 = sampler.t0
    stop = asyncio.Event()
    sampling = asyncio.create_task(sampler.run(stop))
    workload = Workload(args)
    phases: dict[str, dict[str, Any]] = {}
    async with async_client(target, args.timeout_s) as http:

        async def phase(name: str, rate: float | None, duration_s: float) -> list[Outcome]:
            await asyncio.to_thread(wait_idle, target, IDLE_TIMEOUT_S)
            sampler.phase = name
            start_s = time.perf_counter() - t0
            if rate is None:
                outcomes = await closed_loop(http, workload, model, concurrency, duration_s, t0)
            else:
                outcomes = await open_loop(http, workload, model, rate, duration_s, t0)
            end_s = time.perf_counter() - t0
            with httpx.Client(base_url=target.url, timeout=10) as probe:
                await asyncio.to_thread(sampler.sample, probe)  # the phase's last RSS
            phases[name] = {"start_s": start_s, "end_s": end_s, "rate": rate}
            phases[name].update(phase_summary(outcomes, sampler.samples, name, start_s, end_s))
            phases[name]["outcomes"] = outcomes
            return outcomes

        cap = await phase("capacity", None, args.capacity_s)
        start_s = phases["capacity"]["start_s"]
        capacity = capacity_of(cap, start_s, start_s + args.capacity_s)
        if capacity <= 0:
            raise SystemExit("benchmarks.overload: nothing completed in the capacity phase")
        if args.baseline_s > 0:
            await phase("1x", capacity, args.baseline_s)
        await phase("overload", args.load_factor * capacity, args.duration)
    sampler.phase = "idle"
    await asyncio.to_thread(wait_idle, target, IDLE_TIMEOUT_S)
    stop.set()
    await sampling
    return {
        "concurrency": concurrency,
        "capacity_rps": capacity,
        "phases": phases,
        "samples": sampler.samples,
    }


def overload_checks(
    over: dict[str, Any], target_ms: float | None, args: argparse.Namespace
) -> list[dict[str, Any]]:
    c = over["counts"]
    premium = over["ttft_ms"].get(args.premium_tier, {"p99": float("nan"), "n": 0})
    rss = over["rss_mib"]
    growth = rss["max"] - rss["start"]
    return [
        check("excess answered 429", f"{c['rejected_429']}/{c['sent']}", "> 0", c["rejected_429"]),
        check(
            "429s with Retry-After",
            f"{c['rejected_429_with_retry_after']}/{c['rejected_429']}",
            "all",
            c["rejected_429_with_retry_after"] == c["rejected_429"],
        ),
        check("other refusals", c["refused_otherwise"], "== 0", c["refused_otherwise"] == 0),
        check("accepted, not completed", c["incomplete"], "== 0", c["incomplete"] == 0),
        check(
            "RSS growth in overload (MiB)",
            round(growth, 1),
            f"<= {args.max_rss_growth_mib:g}",
            growth <= args.max_rss_growth_mib,
        ),
        check(
            f"{args.premium_tier} p99 TTFT (ms)",
            round(premium["p99"], 1),
            f"<= {target_ms:g}" if target_ms else "no target",
            target_ms is not None and premium["n"] > 0 and premium["p99"] <= target_ms,
        ),
    ]


def _ttft_target(settings: dict[str, Any] | None, tier: str) -> float | None:
    for t in (settings or {}).get("tiers", []):
        if t["name"] == tier:
            return t.get("ttft_target_ms")
    return None


def format_phases(phases: dict[str, dict[str, Any]], premium: str) -> str:
    lines = [
        f"{'phase':>9} {'req/s':>6} {'sent':>5} {'accepted':>8} {'429':>5} {'Retry-After':>11} "
        f"{'incomplete':>10} {'done/s':>6} {premium + ' TTFT p50/p99 ms':>24} "
        f"{'all TTFT p99':>12} {'RSS max MiB':>11}"
    ]
    for name, p in phases.items():
        c, t = p["counts"], p["ttft_ms"].get(premium, {"p50": float("nan"), "p99": float("nan")})
        p99_all = max((v["p99"] for v in p["ttft_ms"].values() if v["n"]), default=float("nan"))
        rate = "closed" if p["rate"] is None else f"{p['rate']:.2f}"
        lines.append(
            f"{name:>9} {rate:>6} {c['sent']:5d} {c['accepted']:8d} {c['rejected_429']:5d} "
            f"{c['rejected_429_with_retry_after']:11d} {c['incomplete']:10d} "
            f"{p['completed_per_s']:6.2f} {t['p50']:11.0f} / {t['p99']:10.0f} "
            f"{p99_all:12.0f} {p['rss_mib']['max'] if p['rss_mib'] else float('nan'):11.0f}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if args.smoke:
        _smoke(args)
    warn_if_loaded()
    out_dir = output_dir(args) / f"overload-{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir.mkdir(parents=True, exist_ok=True)
    with server_under_test(args, out_dir) as target:
        model = model_name(target)
        settings = scheduler_settings(target)
        run = asyncio.run(_phases(target, model, args))
    target_ms = _ttft_target(settings, args.premium_tier)
    phases = run["phases"]
    checks = overload_checks(phases["overload"], target_ms, args)
    print(
        f"capacity {run['capacity_rps']:.2f} req/s (closed loop, {run['concurrency']} streams); "
        f"overload at {args.load_factor:g}x = {phases['overload']['rate']:.2f} req/s for "
        f"{args.duration:g} s"
    )
    print(format_phases(phases, args.premium_tier))
    print(format_checks(checks))
    outcomes = [o for p in phases.values() for o in p.pop("outcomes")]
    result = {
        "server": args.url or f"iterserve serve {args.server_args}",
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "tier_mix": args.tier_mix,
        "load_factor": args.load_factor,
        "capacity_rps": run["capacity_rps"],
        "concurrency": run["concurrency"],
        "premium_ttft_target_ms": target_ms,
        "tiers": (settings or {}).get("tiers"),
        "phases": phases,
        "checks": checks,
        "passed": all(c["passed"] for c in checks),
        "errors": sorted({o.error for o in outcomes if o.kind == "failed" and o.error})[:10],
        "samples": run["samples"],
    }
    (out_dir / "overload.json").write_text(json.dumps(result, indent=1))
    marks = [p["start_s"] for p in phases.values()]
    plot_timeline(run["samples"], outcomes, marks, out_dir / "overload.png", "overload")
    print(f"wrote {out_dir / 'overload.json'} and overload.png")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    from benchmarks.cli_args import parse_args

    raise SystemExit(main(parse_args("overload")))
