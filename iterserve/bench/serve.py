"""``iterserve bench serve``: an online load generator for any OpenAI-compatible server.

Every request is streamed; the client records TTFT, inter-token gaps, TPOT and e2e latency
per request and reports percentiles, throughput, goodput under an SLO, per tier, with the
client's own CPU time (it shares the machine's cores with the server). Arrivals are open-loop
(Poisson at ``--request-rate``, or ``--burst`` groups), closed-loop (``--concurrency``), or
replayed from a trace. ``--sweep`` runs several rates and reports the highest that meets the
SLO. Results: a table, JSON and PNG plots under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from iterserve.workload.stats import (
    SLO,
    RequestRecord,
    cost_per_million_tokens,
    summarize,
    summarize_by_tier,
)
from iterserve.workload.workloads import BenchRequest, load_trace, make_workload


def _body(req: BenchRequest, model: str, endpoint: str, plain: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if req.messages is not None:
        body["messages"] = req.messages
    elif endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if req.tenant is not None:
        body["user"] = req.tenant
    if not plain:
        body["ignore_eos"] = True
        body["min_tokens"] = req.output_len if req.min_tokens is None else req.min_tokens
        if req.priority is not None:
            body["priority"] = req.priority
    return body


def _chunk_has_text(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def send(
    http: httpx.AsyncClient, req: BenchRequest, model: str, endpoint: str, plain: bool
) -> RequestRecord:
    """Send one streamed request; what the client saw."""
    chat = endpoint == "chat" or req.messages is not None
    path = "/v1/chat/completions" if chat else "/v1/completions"
    tier = str(req.priority) if req.priority is not None else "default"
    record = RequestRecord(ok=False, tier=tier)
    start = time.perf_counter()
    last: float | None = None
    num_text_chunks = 0
    try:
        async with http.stream("POST", path, json=_body(req, model, endpoint, plain)) as r:
            record.status = r.status_code
            if r.status_code != 200:
                record.error = (await r.aread()).decode(errors="replace")[:200]
                return record
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.error = str(chunk["error"])[:200]
                    return record
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                    record.prompt_tokens = chunk["usage"]["prompt_tokens"]
                if _chunk_has_text(chunk):
                    now = time.perf_counter()
                    if last is None:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
                    num_text_chunks += 1
    except httpx.HTTPError as e:
        record.error = f"{type(e).__name__}: {e}"
        return record
    record.e2e_s = time.perf_counter() - start
    record.output_tokens = record.output_tokens or num_text_chunks
    record.ok = record.ttft_s is not None
    return record


def arrival_times(
    n: int, rate: float, burst: int | None, burst_interval_s: float, seed: int
) -> list[float]:
    """Open-loop arrival offsets (seconds): Poisson at ``rate`` (inf: all at once), or groups
    of ``burst`` every ``burst_interval_s``."""
    if burst:
        return [(i // burst) * burst_interval_s for i in range(n)]
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed + 1)
    t, times = 0.0, []
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def run_load(
    url: str | list[str],
    requests: list[BenchRequest],
    model: str,
    args: argparse.Namespace,
    rate: float,
    targets: list[int] | None = None,
) -> tuple[list[RequestRecord], float, float]:
    """Drive one run; (records, wall seconds, client CPU seconds).

    Args:
        url: the server, or several (request ``i`` goes to ``url[targets[i]]``: paths
            compared in one run, under the same load).
    """
    urls = [url] if isinstance(url, str) else url
    targets = targets if targets is not None else [0] * len(requests)
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout_s)
    if any(r.arrival_s is not None for r in requests):
        offsets = [r.arrival_s or 0.0 for r in requests]
    else:
        offsets = arrival_times(len(requests), rate, args.burst, args.burst_interval_s, args.seed)
    semaphore = asyncio.Semaphore(args.concurrency) if args.concurrency else None
    bar = tqdm(total=len(requests), desc=f"rate {rate:g}/s", unit="req", disable=args.no_progress)
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(base_url=u, headers=headers, limits=limits, timeout=timeout)
            )
            for u in urls
        ]
        cpu0, t0 = time.process_time(), time.perf_counter()

        async def one(req: BenchRequest, offset: float, target: int) -> RequestRecord:
            http = clients[target]
            if semaphore is None:
                await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
                record = await send(http, req, model, args.endpoint, args.plain)
            else:
                async with semaphore:
                    record = await send(http, req, model, args.endpoint, args.plain)
            bar.update(1)
            return record

        records = await asyncio.gather(
            *[one(r, o, t) for r, o, t in zip(requests, offsets, targets, strict=True)]
        )
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    bar.close()
    return list(records), wall, cpu


def _assign_tiers(requests: list[BenchRequest], mix: str | None, seed: int) -> list[BenchRequest]:
    """``--tier-mix premium=0.2,standard=0.8``: a seeded priority per request."""
    if not mix:
        return requests
    names, weights = [], []
    for part in mix.split(","):
        name, _, weight = part.partition("=")
        names.append(name.strip())
        weights.append(float(weight or 1))
    rng = random.Random(seed + 2)
    return [dataclasses.replace(r, priority=rng.choices(names, weights)[0]) for r in requests]


def _with_arrivals(
    requests: list[BenchRequest], rate: float, args: argparse.Namespace
) -> list[BenchRequest]:
    """The requests with the arrival times an open-loop run at ``rate`` gives them (a saved
    trace replays the same arrivals; closed-loop runs keep none)."""
    if args.concurrency or any(r.arrival_s is not None for r in requests):
        return requests
    offsets = arrival_times(len(requests), rate, args.burst, args.burst_interval_s, args.seed)
    return [dataclasses.replace(r, arrival_s=o) for r, o in zip(requests, offsets, strict=True)]


def format_summary(label: str, s: dict[str, Any]) -> str:
    def f(d: dict[str, float], k: str) -> str:
        return f"{d[k]:8.1f}" if not math.isnan(d[k]) else "       -"

    return (
        f"{label:>14} {s['num_ok']:4d}/{s['num_requests']:<4d} "
        f"{s['output_tokens_per_s']:9.1f} {s['requests_per_s']:7.2f} "
        f"{s['goodput_requests_per_s']:8.2f} "
        f"{f(s['ttft_ms'], 'p50')} {f(s['ttft_ms'], 'p99')} "
        f"{f(s['tpot_ms'], 'p50')} {f(s['tpot_ms'], 'p99')} "
        f"{f(s['itl_ms'], 'p50')} {f(s['itl_ms'], 'p99')} {f(s['e2e_ms'], 'p99')}"
    )


TABLE_HEADER = (
    f"{'run':>14} {'ok/sent':>9} {'out tok/s':>9} {'req/s':>7} {'goodput':>8} "
    f"{'TTFT p50':>8} {'TTFT p99':>8} {'TPOT p50':>8} {'TPOT p99':>8} "
    f"{'ITL p50':>8} {'ITL p99':>8} {'e2e p99':>8}   (ms)"
)


def plot(runs: list[dict[str, Any]], out_dir: Path, stem: str) -> Path:
    """Latency CDFs of each run, and throughput / p99 TTFT against the rate for sweeps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = len(runs) > 1
    fig, axes = plt.subplots(1, 5 if sweep else 3, figsize=(22 if sweep else 14, 4))
    for ax, key, title in zip(
        axes[:3], ("ttft", "tpot", "itl"), ("TTFT", "TPOT", "ITL"), strict=True
    ):
        for run in runs:
            values = sorted(run["samples_ms"][key])
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.plot(values, ys, label=run["label"])
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of requests" if key != "itl" else "fraction of gaps")
        ax.set_title(f"{title} CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if sweep:
        rates = [r["rate"] for r in runs]
        axes[3].plot(rates, [r["summary"]["output_tokens_per_s"] for r in runs], "o-")
        axes[3].set_xlabel("request rate (req/s)")
        axes[3].set_ylabel("output tokens/s")
        axes[3].set_title("throughput vs rate")
        axes[4].plot(rates, [r["summary"]["ttft_ms"]["p99"] for r in runs], "o-")
        axes[4].set_xlabel("request rate (req/s)")
        axes[4].set_ylabel("p99 TTFT (ms)")
        axes[4].set_title("p99 TTFT vs rate")
    fig.tight_layout()
    path = out_dir / f"{stem}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    if path == "default":
        from iterserve.models.loader import resolve_model_dir

        path = str(resolve_model_dir("default"))
    return AutoTokenizer.from_pretrained(path)


def _model_name(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(url + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


def main(args: argparse.Namespace) -> int:
    """Run ``bench serve``'s load (one rate, or each rate of ``--sweep``) against
    ``--url``; print the table, write ``serve-<time>.json`` and ``.png`` in ``--output-dir``.
    Returns 0, or 2 for a trace a real server cannot replay (entries without prompt text)."""
    requests = _requests(args)
    if requests is None:
        return 2
    rates = [float(x) for x in args.sweep.split(",")] if args.sweep else [args.request_rate]
    if args.save_trace is not None:
        from iterserve.workload.workloads import save_trace

        save_trace(_with_arrivals(requests, rates[0], args), args.save_trace)
        print(f"wrote {args.save_trace}")
    url = args.url.rstrip("/")
    model = args.model or _model_name(url, args.api_key)
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    runs = []
    print(TABLE_HEADER)
    for rate in rates:
        records, wall, cpu = asyncio.run(run_load(url, requests, model, args, rate))
        runs.append(_run_report(records, wall, cpu, rate, slo, args))
        _print_run(runs[-1], slo)
    result: dict[str, Any] = {
        "url": url,
        "model": model,
        "workload": str(args.trace) if args.trace else args.workload,
        "num_requests": len(requests),
        "endpoint": args.endpoint,
        "plain": args.plain,
        "concurrency": args.concurrency,
        "slo": asdict(slo),
        "runs": runs,
        # The last (or only) run's summary, what ``bench gate`` compares.
        "summary": runs[-1]["summary"],
    }
    if args.sweep:
        result["best_rate"] = _best_rate(runs, args.slo_attainment)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stem = f"serve-{time.strftime('%Y%m%d-%H%M%S')}"
    json_path = args.output_dir / f"{stem}.json"
    json_path.write_text(json.dumps(result, indent=2))
    png = plot(runs, args.output_dir, stem)
    print(f"wrote {json_path} and {png}")
    return 0


def _requests(args: argparse.Namespace) -> list[BenchRequest] | None:
    """The requests to send (``--trace``, else the seeded ``--workload``; ``--smoke``: 8 of at
    most 16 output tokens), with their ``--tier-mix`` tiers; None (and the error printed)
    for a trace with entries that have only ``prompt_len``."""
    if args.smoke:
        args.num_requests, max_output = 8, 16
    else:
        max_output = 512
    if args.trace is not None:
        requests = load_trace(args.trace)
    else:
        tokenizer = _tokenizer(args.tokenizer)
        requests = make_workload(
            args.workload, tokenizer, args.num_requests, args.seed, max_output_len=max_output
        )
    if any(not r.prompt and r.messages is None for r in requests):
        print(
            "iterserve bench serve: error: the trace has entries with only prompt_len; a real "
            "server needs prompt text (iterserve simulate accepts them)",
            file=sys.stderr,
        )
        return None
    return _assign_tiers(requests, args.tier_mix, args.seed)


def _run_report(
    records: list[RequestRecord],
    wall: float,
    cpu: float,
    rate: float,
    slo: SLO,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One run's entry of the JSON: label, summary (per tier too), client CPU (seconds),
    SLO attainment (fraction), first errors, latency samples (ms) and cost."""
    summary = summarize(records, wall, slo)
    label = args.label or (f"c={args.concurrency}" if args.concurrency else f"rate {rate:g}")
    if args.sweep:
        label = f"rate {rate:g}"
    run: dict[str, Any] = {
        "label": label,
        "rate": rate if not math.isinf(rate) else None,
        "summary": summary,
        "by_tier": summarize_by_tier(records, wall, slo),
        "client_cpu_s": cpu,
        "client_cpu_fraction": cpu / max(wall, 1e-9),
        "slo_attainment": sum(slo.met(r) for r in records) / max(1, len(records)),
        "errors": [r.error for r in records if r.error][:10],
        "samples_ms": {
            "ttft": [r.ttft_s * 1000 for r in records if r.ok and r.ttft_s is not None],
            "tpot": [t * 1000 for r in records if r.ok and (t := r.tpot_s) is not None],
            "itl": [g * 1000 for r in records if r.ok for g in r.itl_s],
        },
    }
    if args.cost_per_hour is not None:
        run["cost_per_1m_output_tokens"] = cost_per_million_tokens(
            args.cost_per_hour, summary["output_tokens_per_s"]
        )
    return run


def _print_run(run: dict[str, Any], slo: SLO) -> None:
    """The run's table row (and one per tier when there are several), then its client CPU,
    SLO attainment and cost."""
    print(format_summary(run["label"], run["summary"]))
    if len(run["by_tier"]) > 1:
        for tier, tier_summary in run["by_tier"].items():
            print(format_summary(f"  {tier}", tier_summary))
    cost = run.get("cost_per_1m_output_tokens")
    print(
        f"{'':>14} client CPU {run['client_cpu_s']:.1f} s "
        f"({run['client_cpu_fraction']:.0%} of a core), "
        f"SLO (TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms) met by "
        f"{run['slo_attainment']:.0%}"
        + (f", ${cost:.2f} per 1M output tokens" if cost is not None else "")
    )


def _best_rate(runs: list[dict[str, Any]], attainment: float) -> float | None:
    """The highest rate (req/s; None for an unbounded one) whose runs met the SLO for at least
    ``attainment`` of requests, printed; None when no rate did."""
    good = [r for r in runs if r["slo_attainment"] >= attainment]
    best = max(good, key=lambda r: r["rate"] or math.inf) if good else None
    print(
        f"highest rate meeting the SLO for {attainment:.0%} of requests: "
        + (best["label"] if best else "none of the rates tried")
    )
    return best["rate"] if best else None
