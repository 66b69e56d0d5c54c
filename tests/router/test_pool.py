"""The pool's in-flight accounting alone: every proxied attempt is bracketed by
``begin_attempt`` / ``end_attempt``, and a replica's report takes over what it counts."""

from __future__ import annotations

import asyncio
import json

import pytest

from iterserve.router.pool import Backend, ReplicaPool
from iterserve.router.scoring import Picker, scores

URL = "http://r:1"


def _pool(reports: list[dict[str, int]]) -> tuple[ReplicaPool, Backend]:
    """A pool of one replica whose polls answer ``reports`` in turn."""

    async def fetch(url: str, headers: dict[str, str]) -> tuple[int, bytes]:
        return 200, json.dumps({"kv_cache_usage": 0.0, **reports.pop(0)}).encode()

    pool = ReplicaPool(fetch, backend_type="iterserve")
    pool.set_urls([URL])
    return pool, pool.backends[URL]


def test_an_attempt_counts_until_it_ends() -> None:
    pool, b = _pool([])
    first = pool.begin_attempt(b)
    second = pool.begin_attempt(b)
    assert (b.in_flight, b.state.in_flight_since_report) == (2, 2)
    assert first.backend is b and first.report is None
    pool.end_attempt(first)
    assert (b.in_flight, b.state.in_flight_since_report) == (1, 1)
    pool.end_attempt(second)
    assert (b.in_flight, b.state.in_flight_since_report) == (0, 0)


def test_a_report_takes_over_the_requests_it_counts() -> None:
    """A poll sets ``in_flight_since_report`` to the attempts the replica did not count yet;
    an attempt begun before that report then ends without taking anything off."""
    pool, b = _pool([
        {"num_running": 1, "num_waiting": 0},
        {"num_running": 0, "num_waiting": 0},
    ])  # fmt: skip
    early = [pool.begin_attempt(b) for _ in range(3)]
    asyncio.run(pool.poll(b))  # the replica runs one of the three
    assert (b.in_flight, b.state.in_flight_since_report) == (3, 2)
    late = pool.begin_attempt(b)  # after the report
    assert late.report is b.state.report
    assert b.state.in_flight_since_report == 3
    for attempt in early:  # their report is gone: the poll already counted them
        pool.end_attempt(attempt)
    assert (b.in_flight, b.state.in_flight_since_report) == (1, 3)
    pool.end_attempt(late)  # begun under this report: it no longer loads the replica
    assert (b.in_flight, b.state.in_flight_since_report) == (0, 2)
    asyncio.run(pool.poll(b))  # nothing open, nothing running
    assert (b.in_flight, b.state.in_flight_since_report) == (0, 0)


def test_the_count_since_the_report_never_goes_below_zero() -> None:
    pool, b = _pool([])
    attempt = pool.begin_attempt(b)
    b.state.in_flight_since_report = 0  # as a poll that saw the request leaves it
    pool.end_attempt(attempt)
    assert (b.in_flight, b.state.in_flight_since_report) == (0, 0)


# What the other servers answer, as vLLM and SGLang document their endpoints: vLLM serves
# GET /load (its in-flight count, not iterserve's report) and the Gateway API inference
# protocol's metrics; SGLang has no /load and its own metric names. One label set per model.
VLLM_LOAD = b'{"server_load": 3}'
VLLM_METRICS = b"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="8000"} 1.0
"""
SGLANG_METRICS = b"""\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="Qwen/Qwen2.5-7B-Instruct"} 4.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="Qwen/Qwen2.5-7B-Instruct"} 1.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="Qwen/Qwen2.5-7B-Instruct"} 0.5
"""


def _auto_pool(answers: dict[str, tuple[int, bytes]]) -> tuple[ReplicaPool, Backend, list[str]]:
    asked: list[str] = []

    async def fetch(url: str, headers: dict[str, str]) -> tuple[int, bytes]:
        path = url.removeprefix(URL)
        asked.append(path)
        return answers.get(path, (404, b'{"detail":"Not Found"}'))

    pool = ReplicaPool(fetch)  # backend_type "auto"
    pool.set_urls([URL])
    return pool, pool.backends[URL], asked


def test_auto_detection_reads_a_vllm_replica_from_its_metrics_though_it_serves_load() -> None:
    pool, b, asked = _auto_pool({"/load": (200, VLLM_LOAD), "/metrics": (200, VLLM_METRICS)})
    asyncio.run(pool.poll(b))
    assert b.kind == "vllm" and b.state.ready and b.poll_failures == 0
    report = b.state.report
    assert report is not None
    assert (report.num_running, report.num_waiting, report.kv_cache_usage) == (2, 5, 0.25)
    assert report.num_total_blocks == 8000
    asyncio.run(pool.poll(b))  # remembered: /metrics only from now on
    assert asked == ["/load", "/metrics", "/metrics"]


def test_auto_detection_reads_an_sglang_replica_without_load() -> None:
    pool, b, asked = _auto_pool({"/metrics": (200, SGLANG_METRICS)})
    asyncio.run(pool.poll(b))
    assert b.kind == "sglang" and b.state.ready
    report = b.state.report
    assert report is not None
    assert (report.num_running, report.num_waiting, report.kv_cache_usage) == (4, 1, 0.5)
    assert asked == ["/load", "/metrics"]


# SGLang's scheduler labels (model_name, engine_type, tp_rank, pp_rank, moe_ep_rank; priority ""
# with --enable-priority-scheduling; dp_rank with data-parallel attention: one scheduler, one
# queue and one KV pool per rank, so queues add up and usage averages). A per-priority series
# next to the total must not count twice.
SGLANG_LABELS = (
    'model_name="Qwen/Qwen3-8B",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"'
)
SGLANG_DP_METRICS = f"""\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{{SGLANG_LABELS},priority="",dp_rank="0"}} 3.0
sglang:num_running_reqs{{{SGLANG_LABELS},priority="",dp_rank="1"}} 5.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{{SGLANG_LABELS},priority="",dp_rank="0"}} 2.0
sglang:num_queue_reqs{{{SGLANG_LABELS},priority="",dp_rank="1"}} 4.0
sglang:num_queue_reqs{{{SGLANG_LABELS},priority="1",dp_rank="1"}} 4.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{{{SGLANG_LABELS},priority="",dp_rank="0"}} 0.6
sglang:token_usage{{{SGLANG_LABELS},priority="",dp_rank="1"}} 0.8
""".encode()


def test_an_sglang_replica_with_data_parallel_ranks_is_read_and_scored_against_vllm() -> None:
    answers = {
        "http://sglang:30000/metrics": (200, SGLANG_DP_METRICS),
        "http://sglang:30000/load": (404, b'{"detail":"Not Found"}'),
        "http://vllm:8000/load": (200, VLLM_LOAD),
        "http://vllm:8000/metrics": (200, VLLM_METRICS),
    }

    async def fetch(url: str, headers: dict[str, str]) -> tuple[int, bytes]:
        return answers[url]

    pool = ReplicaPool(fetch)
    pool.set_urls(["http://sglang:30000", "http://vllm:8000"])
    asyncio.run(pool.poll_all())
    sglang, vllm = pool.named("sglang:30000"), pool.named("vllm:8000")
    assert (sglang.kind, vllm.kind) == ("sglang", "vllm")
    report = sglang.state.report
    assert report is not None and sglang.state.ready
    assert (report.num_running, report.num_waiting) == (8, 6)  # the ranks' totals
    assert report.kv_cache_usage == pytest.approx(0.7)
    # vLLM: 25% KV, 5 waiting; SGLang: 70% KV, 6 waiting: the vLLM replica scores lower.
    now = report.received_at
    picked = Picker("least_kv", prefix_affinity=False).pick(pool.states(), now)
    assert picked.replica.name == "vllm:8000"
    assert scores(pool.states(), now)["sglang:30000"] > scores(pool.states(), now)["vllm:8000"]


def test_auto_detection_keeps_iterserve_on_load() -> None:
    body = {"kv_cache_usage": 0.5, "num_running": 1, "num_waiting": 2, "num_total_blocks": 64}
    pool, b, asked = _auto_pool({"/load": (200, json.dumps(body).encode())})
    asyncio.run(pool.poll(b))
    assert b.kind == "iterserve" and b.state.report is not None
    assert b.state.report.num_waiting == 2
    assert asked == ["/load"]


def test_probe_soon_cuts_an_ejected_replicas_backoff_short() -> None:
    """While requests are held (scale from zero) a replica that was down is probed within
    ``backoff_s``, not after its doubled backoff (up to 30 s): it may be the one starting."""
    now = [100.0]
    pool = ReplicaPool(backend_type="iterserve", clock=lambda: now[0])
    pool.set_urls([URL, "http://ok:1"])
    down, ok = pool.backends[URL], pool.backends["http://ok:1"]
    for _ in range(pool.eject_after + 5):
        pool.record_failure(down, "connection refused")
    assert down.ejected and down.backoff_s == 16.0 and down.next_probe_at == 116.0
    pool.probe_soon()
    assert down.next_probe_at == 100.0 + pool.backoff_s and down.backoff_s == 16.0
    assert ok.next_probe_at == 0.0  # not ejected: polled as ever
    down.next_probe_at = 100.1  # due sooner already: left alone
    pool.probe_soon()
    assert down.next_probe_at == 100.1
