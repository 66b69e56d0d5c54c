"""Admission control, the live-settings merge and metric bookkeeping, without a model."""

from __future__ import annotations

import dataclasses

import pytest

from iterserve.config import SchedulerConfig, Tier
from iterserve.engine.messages import EngineLoad, IterationStats
from iterserve.server.admission import Admission, Rejected
from iterserve.server.live_config import LiveConfigError, VersionedSettings, merge, settings_hash
from iterserve.server.metrics import ServerMetrics


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_queue_full_with_retry_after_from_the_drain_rate() -> None:
    clock = Clock()
    admission = Admission(clock)
    config = SchedulerConfig(max_waiting=2)
    admission.check(config, 1)
    admission.enqueue("a", 1)
    admission.check(config, 1)
    admission.enqueue("b", 1)
    with pytest.raises(Rejected) as e:
        admission.check(config, 1)
    assert e.value.status == 429 and e.value.reason == "queue_full"
    assert e.value.headers["Retry-After"] == "1"  # no drain measured yet
    # Requests leave the queue at 0.5 per second: one more slot takes 2 s.
    for i in range(4):
        admission.enqueue(f"x{i}", 1)
        admission.left_queue(f"x{i}")
        clock.now += 2.0
    with pytest.raises(Rejected) as e:
        admission.check(config, 1)
    rate = admission.drain_rate()
    assert rate is not None and rate == pytest.approx(4 / 8)  # 4 left in the 8 s since the first
    assert e.value.headers["Retry-After"] == "2"
    admission.left_queue("a")
    admission.check(config, 1)


def test_tier_queue_wait_counts_only_requests_ahead() -> None:
    clock = Clock()
    admission = Admission(clock)
    tiers = (
        Tier("premium", 0),
        Tier("standard", 1),
        Tier("best-effort", 2, max_queue_wait_ms=1500),
    )
    config = SchedulerConfig(tiers=tiers, max_waiting=100)
    for i in range(3):  # drain rate: 3 requests over 2 s (best-effort: none overtakes)
        admission.enqueue(f"d{i}", 2)
        admission.left_queue(f"d{i}")
        clock.now += 1.0
    clock.now -= 1.0
    clock.now -= 40.0  # accepted long ago: no recent standard arrivals to overtake
    for i in range(3):
        admission.enqueue(f"s{i}", 1)
    clock.now += 40.0
    admission.check(config, 0)  # premium: no limit
    with pytest.raises(Rejected) as e:
        admission.check(config, 2)  # 3 ahead / 1.5 per s = 2 s > 1.5 s
    assert e.value.reason == "queue_wait" and e.value.headers["Retry-After"] == "1"
    admission.left_queue("s0")
    admission.check(config, 2)  # 2 ahead: 1.33 s


def test_draining_refuses_with_503() -> None:
    admission = Admission()
    admission.draining = True
    with pytest.raises(Rejected) as e:
        admission.check(SchedulerConfig(), 1)
    assert e.value.status == 503 and e.value.reason == "shutting_down"


def test_left_queue_is_idempotent_and_only_starts_count() -> None:
    clock = Clock()
    admission = Admission(clock)
    admission.enqueue("a", 1)
    admission.left_queue("a", started=False)
    admission.left_queue("a")
    assert not admission.queued and admission.drain_rate() is None


def current(**kwargs: object) -> VersionedSettings:
    return VersionedSettings(SchedulerConfig(**kwargs), 3)  # type: ignore[arg-type]


def test_merge_validates_the_whole_result() -> None:
    base = current(max_num_seqs=8, max_num_batched_tokens=64)
    with pytest.raises(LiveConfigError, match="must be >= max_num_seqs"):
        merge(base, {"max_num_seqs": 100}, swap_space=0, max_model_len=2048)
    merged = merge(
        base, {"max_num_seqs": 100, "max_num_batched_tokens": 256}, swap_space=0, max_model_len=2048
    )
    assert merged is not None and merged.config.max_num_seqs == 100 and merged.version == 4


def test_merge_takes_integral_floats_for_integer_settings() -> None:
    """JSON Schema's ``integer`` includes ``2.0`` (the schema says integer): it is 2; ``2.5``
    is still refused."""
    merged = merge(current(), {"max_num_seqs": 2.0}, swap_space=0, max_model_len=2048)
    assert merged is not None and merged.config.max_num_seqs == 2
    assert type(merged.config.max_num_seqs) is int
    with pytest.raises(LiveConfigError, match="max_num_seqs"):
        merge(current(), {"max_num_seqs": 2.5}, swap_space=0, max_model_len=2048)


def test_merge_without_chunked_prefill_keeps_the_budget_over_max_model_len() -> None:
    base = current(enable_chunked_prefill=False, max_num_batched_tokens=2048)
    with pytest.raises(LiveConfigError, match="max_model_len"):
        merge(base, {"max_num_batched_tokens": 512}, swap_space=0, max_model_len=2048)


def test_merge_swap_needs_swap_space() -> None:
    with pytest.raises(LiveConfigError, match="swap space"):
        merge(current(), {"preemption_mode": "swap"}, swap_space=0, max_model_len=2048)
    merged = merge(current(), {"preemption_mode": "swap"}, swap_space=1.0, max_model_len=2048)
    assert merged is not None and merged.config.preemption_mode == "swap"


def test_merge_versions() -> None:
    base = current()
    assert merge(base, {}, 0, 2048) is None
    assert merge(base, {"max_waiting": 1024}, 0, 2048) is None  # the default: no change
    assert merge(base, {"config_version": 3}, 0, 2048) is None
    assert merge(base, {"config_version": 2}, 0, 2048) is None
    bumped = merge(base, {"config_version": 9}, 0, 2048)
    assert bumped is not None and bumped.version == 9 and bumped.config == base.config
    changed = merge(base, {"aging_interval_s": 1.0, "config_version": 1}, 0, 2048)
    assert changed is not None and changed.version == 4


def test_settings_hash_is_canonical() -> None:
    a = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    b = dataclasses.replace(
        SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), max_num_seqs=4
    )
    assert settings_hash(a) == settings_hash(b)
    assert settings_hash(a) != settings_hash(SchedulerConfig())
    # Settings that are not live do not change the hash.
    assert settings_hash(dataclasses.replace(a, scheduling_policy="fcfs")) == settings_hash(a)


# ----------------------------------------------------------------- preemption metrics


def _preemptions(metrics: ServerMetrics) -> dict[tuple[str, str], float]:
    return {
        (s.labels["mode"], s.labels["reason"]): s.value
        for family in metrics.registry.collect()
        if family.name == "iterserve_num_preemptions"
        for s in family.samples
        if s.name == "iterserve_num_preemptions_total"
    }


def test_preemptions_are_counted_by_mode_and_reason_every_pair_from_the_start() -> None:
    metrics = ServerMetrics()
    pairs = {(m, r) for m in ("recompute", "swap") for r in ("kv", "priority")}
    assert _preemptions(metrics) == dict.fromkeys(pairs, 0.0)
    stats = IterationStats(
        time=1.0,
        latency_s=0.01,
        num_prefill_tokens=0,
        num_decode_tokens=4,
        num_running=4,
        num_waiting=0,
        num_swapped=3,
        num_free_blocks=0,
        num_preemptions=10,  # 5 kv (1 swap + 4 recompute) + 5 priority
        num_swap_preemptions=4,  # 1 kv + 3 priority
        num_priority_preemptions=5,  # 3 swap + 2 recompute
        num_priority_swap_preemptions=3,
    )
    metrics.observe_iterations([stats, stats], EngineLoad())
    assert _preemptions(metrics) == {
        ("swap", "kv"): 2.0,
        ("recompute", "kv"): 8.0,
        ("swap", "priority"): 6.0,
        ("recompute", "priority"): 4.0,
    }
