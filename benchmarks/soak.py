"""``python -m benchmarks.soak``: a long run of mixed traffic under live config changes.

Open-loop Poisson arrivals at ``--request-rate`` for ``--duration`` seconds: tiers (premium 20%,
standard 50%, best-effort 30%), prompts of 16-1024 tokens (log-normal, median 200), outputs of
8-256 tokens, 70% streamed, 10% cancelled by the client at a random moment (waiting, prefill
or decode). Every ``--config-interval`` seconds a ``PUT /admin/scheduler_config`` applies the
next of :data:`CONFIG_CYCLE` (seats, token budget, prefill chunk, watermark, preemption,
aging, ``max_waiting``, tier limits; the last entry restores the settings the server started
with). RSS (the server's process tree) and ``/load`` are sampled every ``--sample-interval``.

Checks at the end (exit 1 when one fails):

- **no stuck requests**: every request sent ended: completed, answered with an error or a
  429/503, or cancelled by the client; none still open ``--drain-timeout-s`` after the
  traffic stopped, none whose connection closed without an answer, none that the server
  accepted and left unfinished;
- **no leaked blocks**: once idle, ``/load`` shows zero used KV blocks (prefix-cached blocks
  count as free: evictable), zero running, waiting or swapped;
- **RSS bounded**: RSS when idle at the end minus the RSS after the warm-up (``--warmup-s``,
  default one pass through the config cycle: each setting runs other batch shapes and fills
  other allocator pools, caches and prefix-cache entries) is at most
  ``--max-rss-growth-mib``; growth after it is what a leak would show;
- every live config change answered 200.

The in-run reference: the warm-up window's figures (RSS, throughput) against the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from typing import Any

import httpx

from benchmarks.reliability import (
    Outcome,
    Prompts,
    RequestSpec,
    Sampler,
    Target,
    admin_headers,
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

TIER_MIX = {"premium": 0.2, "standard": 0.5, "best-effort": 0.3}
STREAM_SHARE = 0.7
ABORT_SHARE = 0.1
# Live changes, applied in turn; each sets the three coupled budget keys together so that
# any order is valid (max_num_batched_tokens >= max_num_seqs >= 1, threshold <= budget).
CONFIG_CYCLE: list[dict[str, Any]] = [
    {"max_num_seqs": 8, "max_num_batched_tokens": 128, "long_prefill_token_threshold": 64},
    {"max_num_seqs": 64, "max_num_batched_tokens": 512, "long_prefill_token_threshold": 0},
    {"max_waiting": 16, "kv_watermark": 0.05, "aging_interval_s": 1.0},
    {"preemption_mode": "recompute", "priority_preemption_margin": 1},
    {
        "tiers": [
            {"name": "premium", "priority": 0, "max_queue_wait_ms": 300, "ttft_target_ms": 1000},
            {"name": "standard", "priority": 1, "max_queue_wait_ms": 1000},
            {"name": "best-effort", "priority": 2, "max_queue_wait_ms": 2000},
        ]
    },
    {"max_num_seqs": 16, "max_num_batched_tokens": 256, "long_prefill_token_threshold": 32},
]


def _smoke(args: argparse.Namespace) -> None:
    args.duration, args.config_interval, args.warmup_s = 6.5, 0.8, 1.5
    args.sample_interval, args.request_rate, args.drain_timeout_s = 0.5, 6.0, 30.0


def make_spec(rng: random.Random, prompts: Prompts, max_output: int) -> RequestSpec:
    """One request of the soak's mix (see the module docstring)."""
    prompt_len = int(min(1024, max(16, rng.lognormvariate(math.log(200), 0.8))))
    abort = rng.random() < ABORT_SHARE
    return RequestSpec(
        prompt=prompts.cut(prompt_len, rng.randrange(1 << 30)),
        max_tokens=rng.randint(8, max_output),
        tier=rng.choices(list(TIER_MIX), list(TIER_MIX.values()))[0],
        stream=rng.random() < STREAM_SHARE,
        abort_after_s=rng.uniform(0.05, 3.0) if abort else None,
    )


async def _traffic(
    target: Target, model: str, args: argparse.Namespace, t0: float
) -> tuple[list[Outcome], int]:
    """Poisson arrivals until ``--duration``; (outcomes, requests still open after the drain
    timeout, which were cancelled and counted stuck)."""
    rng = random.Random(args.seed)
    prompts = Prompts()
    tasks: list[asyncio.Task[Outcome]] = []
    async with async_client(target, args.timeout_s) as http:
        next_s = 0.0
        while next_s < args.duration:
            await asyncio.sleep(max(0.0, t0 + next_s - time.perf_counter()))
            spec = make_spec(rng, prompts, 32 if args.smoke else 256)
            tasks.append(asyncio.create_task(send(http, spec, model, t0)))
            next_s += rng.expovariate(args.request_rate)
        done, pending = await asyncio.wait(tasks, timeout=args.drain_timeout_s)
        for task in pending:
            task.cancel()
        return [t.result() for t in tasks if t in done], len(pending)


async def _change_config(
    target: Target, args: argparse.Namespace, t0: float, initial: dict[str, Any]
) -> list[dict[str, Any]]:
    """A PUT every ``--config-interval`` s until ``--duration``; one row per PUT."""
    restore = {k: v for k, v in initial.items() if k not in ("config_version", "config_hash")}
    cycle = [*CONFIG_CYCLE, restore]
    changes: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=target.url, headers=admin_headers(target)) as http:
        while True:
            at_s = (len(changes) + 1) * args.config_interval
            if at_s >= args.duration:
                return changes
            await asyncio.sleep(max(0.0, t0 + at_s - time.perf_counter()))
            body = cycle[len(changes) % len(cycle)]
            try:
                r = await http.put("/admin/scheduler_config", json=body, timeout=30)
                status, version = r.status_code, r.json().get("config_version")
            except httpx.HTTPError as e:
                status, version = None, f"{type(e).__name__}: {e}"
            changes.append(
                {"t_s": time.perf_counter() - t0, "keys": sorted(body), "status": status,
                 "config_version": version}
            )  # fmt: skip


async def _run(target: Target, model: str, args: argparse.Namespace) -> dict[str, Any]:
    initial = scheduler_settings(target)
    if initial is None:
        raise SystemExit("benchmarks.soak: live changes need the admin token (--admin-token)")
    sampler = Sampler(target, args.sample_interval)
    t0 = sampler.t0
    stop = asyncio.Event()
    sampling = asyncio.create_task(sampler.run(stop))
    sampler.phase = "traffic"
    (outcomes, num_stuck), changes = await asyncio.gather(
        _traffic(target, model, args, t0), _change_config(target, args, t0, initial)
    )
    sampler.phase = "idle"
    idle = await asyncio.to_thread(wait_idle, target, args.drain_timeout_s)
    with httpx.Client(base_url=target.url, timeout=10) as http:
        await asyncio.sleep(1.0)  # let freed memory settle before the last sample
        final = sampler.sample(http)
    stop.set()
    await sampling
    return {
        "outcomes": outcomes,
        "num_stuck": num_stuck,
        "changes": changes,
        "idle": idle,
        "final": final,
        "samples": sampler.samples,
    }


def _rss_after_warmup(samples: list[dict[str, Any]], warmup_s: float) -> float:
    after = [s["rss_mib"] for s in samples if s["t_s"] >= warmup_s]
    return after[0] if after else samples[-1]["rss_mib"]


def _rss_slope(samples: list[dict[str, Any]], warmup_s: float) -> float | None:
    """MiB per hour of a least-squares line through the RSS samples after the warm-up (None
    with fewer than 3)."""
    after = [s for s in samples if s["t_s"] >= warmup_s]
    if len(after) < 3:
        return None
    times, rss = [s["t_s"] for s in after], [s["rss_mib"] for s in after]
    slope, _ = statistics.linear_regression(times, rss)
    return slope * 3600


def _rate(outcomes: list[Outcome], start_s: float, end_s: float) -> float:
    done = [o for o in outcomes if o.kind == "completed" and o.end_s is not None]
    return sum(start_s <= o.end_s < end_s for o in done if o.end_s) / max(1e-9, end_s - start_s)


def summarize(run: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    outcomes: list[Outcome] = run["outcomes"]
    c = counts(outcomes)
    c["stuck"] += run["num_stuck"]
    idle, samples = run["idle"], run["samples"]
    rss_warm = _rss_after_warmup(samples, args.warmup_s)
    rss_end = run["final"]["rss_mib"]
    rss = {
        "start_mib": samples[0]["rss_mib"],
        "after_warmup_mib": rss_warm,
        "max_mib": max(s["rss_mib"] for s in samples),
        "end_mib": rss_end,
        "growth_after_warmup_mib": rss_end - rss_warm,
        "slope_after_warmup_mib_per_hour": _rss_slope(samples, args.warmup_s),
        "bound_mib": args.max_rss_growth_mib,
    }
    changes = run["changes"]
    checks = [
        check("requests without an end (stuck)", c["stuck"], "== 0", c["stuck"] == 0),
        check(
            "connections closed without an answer",
            c["connection_errors"],
            "== 0",
            c["connection_errors"] == 0,
        ),
        check(
            "accepted, not cancelled, not completed",
            c["incomplete"],
            "== 0",
            c["incomplete"] == 0,
        ),
        check("used KV blocks when idle", idle["used_blocks"], "== 0", idle["used_blocks"] == 0),
        check(
            "running + waiting + swapped when idle",
            idle["num_running"] + idle["num_waiting"] + idle["num_swapped"],
            "== 0",
            idle["num_running"] + idle["num_waiting"] + idle["num_swapped"] == 0,
        ),
        check(
            "RSS growth after warm-up (MiB)",
            round(rss["growth_after_warmup_mib"], 1),
            f"<= {args.max_rss_growth_mib:g}",
            rss["growth_after_warmup_mib"] <= args.max_rss_growth_mib,
        ),
        check(
            "live config changes answered 200",
            f"{sum(ch['status'] == 200 for ch in changes)}/{len(changes)}",
            "all",
            bool(changes) and all(ch["status"] == 200 for ch in changes),
        ),
    ]
    end_s = max((o.end_s or 0.0) for o in outcomes) if outcomes else 0.0
    return {
        "counts": c,
        "rss": rss,
        "idle_load": idle,
        "completed_per_s": {
            "warmup": _rate(outcomes, 0.0, args.warmup_s),
            "after_warmup": _rate(outcomes, args.warmup_s, end_s),
        },
        "config_changes": changes,
        "checks": checks,
        "passed": all(ch["passed"] for ch in checks),
        "errors": sorted({o.error for o in outcomes if o.kind == "failed" and o.error})[:10],
    }


def main(args: argparse.Namespace) -> int:
    if args.smoke:
        _smoke(args)
    if args.warmup_s is None:
        args.warmup_s = (len(CONFIG_CYCLE) + 1) * args.config_interval
    if args.duration <= args.warmup_s + args.config_interval:
        print(
            f"error: --duration {args.duration:g} s leaves no time after the warm-up "
            f"({args.warmup_s:g} s: by default one cycle of {len(CONFIG_CYCLE) + 1} config "
            f"changes x --config-interval {args.config_interval:g} s) for a config change and "
            "an RSS trend: pass a longer --duration, or a shorter --config-interval / "
            "--warmup-s",
            file=sys.stderr,
        )
        return 2
    warn_if_loaded()
    out_dir = output_dir(args) / f"soak-{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir.mkdir(parents=True, exist_ok=True)
    with server_under_test(args, out_dir) as target:
        model = model_name(target)
        print(
            f"soak: {args.duration:g} s at {args.request_rate:g} req/s, a config change every "
            f"{args.config_interval:g} s, against {target.url}"
        )
        run = asyncio.run(_run(target, model, args))
    summary = summarize(run, args)
    c = summary["counts"]
    print(
        f"sent {c['sent']}: completed {c['completed']}, rejected {c['rejected']} "
        f"({c['rejected_429_with_retry_after']}/{c['rejected_429']} 429s with Retry-After), "
        f"cancelled by the client {c['aborted']}, failed {c['failed']} (connection errors "
        f"{c['connection_errors']}), stuck {c['stuck']}"
    )
    rss = summary["rss"]
    rates = summary["completed_per_s"]
    print(
        f"RSS MiB: start {rss['start_mib']:.0f}, after warm-up {rss['after_warmup_mib']:.0f}, "
        f"max {rss['max_mib']:.0f}, idle at the end {rss['end_mib']:.0f} (after warm-up "
        f"{rss['slope_after_warmup_mib_per_hour'] or math.nan:+.1f} MiB/hour); completed/s "
        f"{rates['warmup']:.2f} in warm-up, {rates['after_warmup']:.2f} after; "
        f"{len(summary['config_changes'])} live config changes"
    )
    print(format_checks(summary["checks"]))
    result = {
        "duration_s": args.duration,
        "request_rate": args.request_rate,
        "config_interval_s": args.config_interval,
        "warmup_s": args.warmup_s,
        "server": args.url or f"iterserve serve {args.server_args}",
        **summary,
        "samples": run["samples"],
    }
    (out_dir / "soak.json").write_text(json.dumps(result, indent=1))
    plot_timeline(
        run["samples"],
        run["outcomes"],
        [ch["t_s"] for ch in summary["config_changes"]],
        out_dir / "soak.png",
        "soak",
    )
    print(f"wrote {out_dir / 'soak.json'} and soak.png")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    from benchmarks.cli_args import parse_args

    raise SystemExit(main(parse_args("soak")))
