"""The canary deploy gate's arithmetic (quantiles from bucket deltas, as Prometheus's
histogram_quantile) and the rollout's state machine (:func:`iterserve.operator.rollout.plan`)
on scrapes the test writes: every figure below is computed by hand."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from iterserve.operator import gate
from iterserve.operator.push import PodTarget
from iterserve.operator.rollout import (
    BAKING,
    PROMOTED,
    ROLLED_BACK,
    SUPERSEDED,
    UNCHECKED,
    Settings,
    Step,
    judge_window,
    plan,
    replacing,
    timestamp,
)
from iterserve.operator.spec import RolloutSpec

BOUNDS = ("0.1", "0.2", "0.4", "0.8", "+Inf")


def buckets(*values_s: float) -> gate.Buckets:
    """Cumulative buckets over :data:`BOUNDS` of these observations."""
    return {le: float(sum(v <= float(le) for v in values_s)) for le in BOUNDS}


# -- quantiles ---------------------------------------------------------------------------------


def test_quantile_interpolates_inside_the_bucket_as_prometheus() -> None:
    b = {"0.1": 10.0, "0.2": 20.0, "0.4": 40.0, "+Inf": 40.0}
    assert gate.quantile(0.5, b) == pytest.approx(0.2)  # rank 20: the top of (0.1, 0.2]
    assert gate.quantile(0.99, b) == pytest.approx(0.2 + 0.2 * 19.6 / 20)  # rank 39.6
    assert gate.quantile(0.25, b) == pytest.approx(0.1 + 0.1 * 0 / 10)  # rank 10: 0.1
    assert gate.quantile(0.125, b) == pytest.approx(0.05)  # the first bucket starts at 0


def test_quantile_in_the_inf_bucket_is_the_largest_finite_bound() -> None:
    assert gate.quantile(0.9, {"0.1": 5.0, "0.2": 5.0, "+Inf": 10.0}) == 0.2


def test_quantile_of_nothing_is_none_and_q_is_checked() -> None:
    assert gate.quantile(0.5, {}) is None
    assert gate.quantile(0.5, {"0.1": 0.0, "+Inf": 0.0}) is None
    with pytest.raises(ValueError, match="quantile"):
        gate.quantile(1.5, buckets(0.1))


def test_window_is_the_delta_and_a_reset_counts_whole() -> None:
    start, now = buckets(0.05, 0.3), buckets(0.05, 0.3, 0.15, 0.9)
    assert gate.window(start, now) == buckets(0.15, 0.9)
    assert gate.window(None, now) == now  # a pod born in the window
    restarted = buckets(0.7)  # counts went down: a new process
    assert gate.window(now, restarted) == restarted
    assert gate.add(buckets(0.1), buckets(0.3)) == buckets(0.1, 0.3)


def test_snapshot_sums_the_tiers_of_a_real_exposition() -> None:
    registry = CollectorRegistry()
    ttft = Histogram(gate.TTFT.removesuffix("_seconds"), "TTFT", ["tier"],
                     unit="seconds", buckets=(0.1, 0.2), registry=registry)  # fmt: skip
    for tier, value in (("premium", 0.05), ("batch", 0.15), ("batch", 0.5)):
        ttft.labels(tier=tier).observe(value)
    snapshot = gate.parse_snapshot(generate_latest(registry).decode())
    assert snapshot == {gate.TTFT: {"0.1": 1.0, "0.2": 2.0, "+Inf": 3.0}}


@pytest.mark.parametrize(
    "bucket",
    ['{le="fast"} 5', '{le="+Inf"} NaN', '{le="+Inf"} +Inf', '{le="+Inf"} -5', '{le="NaN"} 1'],
)
def test_a_garbage_histogram_is_not_the_text_format(bucket: str) -> None:
    # Breaker finding: these parsed, then crashed the gate (float('fast'), int(nan)) on every
    # reconcile, or put NaN into status.rollout (not JSON): a pod's garbage blocked the resource.
    page = f"# TYPE {gate.TTFT} histogram\n{gate.TTFT}_bucket{bucket}\n"
    with pytest.raises(ValueError):
        gate.parse_snapshot(page)


def test_the_gate_compares_p99_ttft_and_median_tpot() -> None:
    limits = gate.GateLimits(
        max_ttft_p99_regression_pct=20, max_tpot_p50_regression_pct=15, min_requests=4
    )
    same = {gate.TTFT: buckets(0.05, 0.05, 0.15, 0.15), gate.TPOT: buckets(0.05, 0.05, 0.05, 0.05)}
    verdict = gate.judge(same, same, limits)
    assert verdict.enough and verdict.within
    assert [f.ratio for f in verdict.figures] == [1.0, 1.0]
    slow = {**same, gate.TTFT: buckets(0.05, 0.05, 0.15, 0.7)}  # p99 in (0.4, 0.8]
    verdict = gate.judge(slow, same, limits)
    assert not verdict.within
    ttft, tpot = verdict.figures
    # rank 3.96 of 4. Canary: 3 of 4 at or under 0.4, the 4th in (0.4, 0.8] -> 0.4 + 0.4 * 0.96;
    # baseline: 2 under 0.1, 2 in (0.1, 0.2] -> 0.1 + 0.1 * (3.96 - 2) / 2.
    assert (ttft.canary_s, ttft.baseline_s) == (pytest.approx(0.784), pytest.approx(0.198))
    assert ttft.ratio == pytest.approx(0.784 / 0.198) and not ttft.within and tpot.within
    assert verdict.text() == (
        "TTFT p99 0.784 s vs baseline 0.198 s (+296%, limit +20%); "
        "TPOT p50 0.050 s vs baseline 0.050 s (+0%, limit +15%)"
    )
    few = gate.judge({gate.TTFT: buckets(0.1), gate.TPOT: buckets(0.1)}, same, limits)
    assert (few.enough, few.within, few.canary_requests, few.baseline_requests) == (
        False, False, 1, 4,
    )  # fmt: skip
    assert few.text() == "not enough traffic: canaries 1, baseline 4 requests"
    assert gate.Figure("x", 0.1, 0.0, 20).ratio == math.inf


def test_the_limits_are_percent_of_the_baseline() -> None:
    # spec.rollout's maxTtftP99RegressionPct / maxTpotP50RegressionPct (DESIGN.md): 20 allows
    # up to 1.2 times the baseline's quantile, the limit itself included; 0 allows no slowdown.
    at_limit, beyond = gate.Figure("x", 0.3, 0.25, 20), gate.Figure("x", 0.31, 0.25, 20)
    assert (at_limit.within, beyond.within) == (True, False)
    assert at_limit.regression_pct == pytest.approx(20)
    assert at_limit.text() == "x 0.300 s vs baseline 0.250 s (+20%, limit +20%)"
    faster = gate.Figure("x", 0.2, 0.25, 0)
    assert faster.within and faster.text() == "x 0.200 s vs baseline 0.250 s (-20%, limit +0%)"
    assert not gate.Figure("x", 0.2501, 0.25, 0).within
    assert gate.Figure("x", 0.1, 0.0, 12.5).text().endswith("(+inf%, limit +12.5%)")


def test_a_pod_that_failed_its_first_scrape_is_left_out() -> None:
    limits = gate.GateLimits(min_requests=1)
    start: dict[str, Any] = {"a": _pod(), "b": None}
    now = {"a": _pod(0.1), "b": _pod(0.7, 0.7), "c": _pod(0.3), "d": None}
    verdict = judge_window(start, now, [PodTarget("a", "")], limits)
    # b is out (its start is unknown), c counts whole (born in the window), d did not answer.
    assert (verdict.canary_requests, verdict.baseline_requests) == (1, 1)
    assert verdict.figures[0].baseline_s == pytest.approx(0.2 + 0.2 * 0.99)


# -- the state machine -------------------------------------------------------------------------

OLD = Settings({"max_num_seqs": 8, "max_waiting_per_tenant": None}, "old-hash", 1)  # every key
NEW = Settings({"max_num_seqs": 1}, "new-hash", 2)
CANARY = RolloutSpec(strategy="canary", bakeSeconds=10, minRequests=2)
T0 = 1_800_000_000.0


def _pod(*ttft_s: float, tpot_s: float = 0.05) -> gate.Snapshot:
    return {gate.TTFT: buckets(*ttft_s), gate.TPOT: buckets(*[tpot_s] * len(ttft_s))}


class Pods:
    """Ready pods and what their /metrics say now (the test appends observations)."""

    def __init__(self, *names: str) -> None:
        self.targets = [PodTarget(n, f"http://{n}") for n in names]
        self.ttft: dict[str, list[float]] = {n: [] for n in names}

    async def scrape(self, pods: list[PodTarget]) -> dict[str, gate.Snapshot | None]:
        return {p.name: _pod(*self.ttft[p.name]) for p in pods}

    def step(
        self, record: dict[str, Any], now_s: float, spec: RolloutSpec = CANARY, desired: Any = NEW
    ) -> Step:
        return asyncio.run(plan(spec, desired, OLD, record, self.targets, self.scrape, now_s))


def _groups(step: Step) -> dict[str, list[str]]:
    return {p.settings.hash: [t.name for t in p.pods] for p in step.pushes if p.pods}


def test_a_change_goes_to_the_first_pods_by_name_and_the_configmap_keeps_the_old() -> None:
    pods = Pods("pod-c", "pod-a", "pod-b")
    pods.ttft["pod-a"] = [0.05]  # traffic before the rollout: not in the window
    step = pods.step({}, T0, RolloutSpec(strategy="canary", canaryPods=5))
    assert _groups(step) == {"new-hash": ["pod-a", "pod-b"], "old-hash": ["pod-c"]}  # 1 stays
    assert step.config_map == OLD
    assert step.record is not None and step.record["phase"] == BAKING
    assert step.record["windowStart"]["pod-a"] == _pod(0.05)
    assert json.loads(step.record["stableSettings"]) == OLD.values
    assert step.condition is not None and step.condition[:2] == ("Unknown", BAKING)
    assert step.events[0][:2] == ("Normal", "RolloutStarted")


def test_within_the_gate_it_is_promoted_once_the_bake_is_over() -> None:
    pods = Pods("a", "b")
    record = pods.step({}, T0).record
    assert record is not None
    pods.ttft["a"] += [0.05, 0.15]
    pods.ttft["b"] += [0.05, 0.15]
    early = pods.step(record, T0 + 5)  # half the bake: still baking, on the same groups
    assert early.record is not None and early.record["phase"] == BAKING and early.outcome is None
    assert _groups(early) == {"new-hash": ["a"], "old-hash": ["b"]}
    done = pods.step(early.record, T0 + 10)
    assert done.record is not None and done.record["phase"] == PROMOTED
    assert (_groups(done), done.config_map, done.outcome) == ({"new-hash": ["a", "b"]}, NEW,
                                                              "promoted")  # fmt: skip
    assert done.condition is not None and done.condition[:2] == ("True", PROMOTED)
    assert not {"windowStart", "stableSettings"} & set(done.record)  # the bake's state gone
    again = pods.step(done.record, T0 + 20)  # later reconciles: everyone on the new settings
    assert (_groups(again), again.outcome) == ({"new-hash": ["a", "b"]}, None)


def test_too_little_traffic_extends_the_bake() -> None:
    pods = Pods("a", "b")
    record = pods.step({}, T0).record
    pods.ttft["a"] += [0.05]
    step = pods.step(dict(record or {}), T0 + 60)
    assert step.record is not None and step.record["phase"] == BAKING
    assert step.condition is not None and step.condition[1] == "WaitingForTraffic"
    assert "not enough traffic: canaries 1, baseline 0 requests" in step.condition[2]


def test_beyond_the_gate_it_is_rolled_back_early_and_never_retried() -> None:
    pods = Pods("a", "b")
    record = pods.step({}, T0).record
    pods.ttft["a"] += [0.7, 0.7]
    pods.ttft["b"] += [0.05, 0.05]
    step = pods.step(dict(record or {}), T0 + 3)  # before the bake's end: enough to tell
    assert step.record is not None and step.record["phase"] == ROLLED_BACK
    assert step.record["rejectedHash"] == "new-hash"
    assert (_groups(step), step.config_map, step.outcome) == ({"old-hash": ["a", "b"]}, OLD,
                                                              "rolled_back")  # fmt: skip
    ((kind, reason, message),) = step.events
    assert (kind, reason) == ("Warning", "RolloutRolledBack")
    # rank 1.98 of 2: canary 0.4 + 0.4 * 0.99, baseline 0.1 * 0.99.
    assert "after 3 s: TTFT p99 0.796 s vs baseline 0.099 s (+704%, limit +20%)" in message
    assert step.applied == step.condition and step.condition is not None
    assert step.condition[:2] == ("False", ROLLED_BACK)
    for later in (T0 + 20, T0 + 3600):  # the same spec: the old settings stay, no new rollout
        again = pods.step(step.record, later)
        assert (_groups(again), again.events, again.outcome) == ({"old-hash": ["a", "b"]}, [], None)
        assert again.record == step.record
    # A new change of the spec (a new version), even to the same settings, is tried again.
    retry = pods.step(step.record, T0 + 4000, desired=Settings(NEW.values, NEW.hash, 3))
    assert retry.record is not None and retry.record["phase"] == BAKING


def test_one_pod_has_nothing_to_compare_with() -> None:
    step = Pods("a").step({}, T0)
    assert _groups(step) == {"new-hash": ["a"]} and step.config_map == NEW
    assert step.record is not None and step.record["phase"] == UNCHECKED
    assert step.outcome == "unchecked" and step.events[0][1] == "RolloutUnchecked"


def test_the_specs_percent_limits_reach_the_gate() -> None:
    # The canary of the test above (x8.04 the baseline's TTFT p99) within +800%: promoted.
    loose = RolloutSpec(
        strategy="canary", bakeSeconds=10, minRequests=2, maxTtftP99RegressionPct=800
    )
    pods = Pods("a", "b")
    record = pods.step({}, T0, loose).record
    pods.ttft["a"] += [0.7, 0.7]
    pods.ttft["b"] += [0.05, 0.05]
    step = pods.step(dict(record or {}), T0 + 3, loose)
    assert step.condition is not None and step.condition[1] == BAKING
    assert "(+704%, limit +800%)" in step.condition[2] and "of 10 s:" in step.condition[2]
    step = pods.step(dict(step.record or {}), T0 + 10, loose)
    assert step.record is not None and step.record["phase"] == PROMOTED


def test_canaries_gone_start_the_rollout_again_and_a_revert_supersedes_it() -> None:
    pods = Pods("a", "b", "c")
    record = pods.step({}, T0).record
    assert record is not None and record["canaryPods"] == ["a"]
    two = Pods("a", "b")
    two.targets = two.targets[:1]  # the only baseline pod restarting: no promotion unchecked
    waiting = two.step(record, T0 + 5)
    assert waiting.record == record and _groups(waiting) == {"new-hash": ["a"]}
    assert waiting.condition is not None and waiting.condition[1] == "WaitingForPods"
    pods.targets = pods.targets[1:]  # pod a deleted
    step = pods.step(record, T0 + 5)
    assert step.record is not None and step.record["canaryPods"] == ["b"]
    assert step.record["startedAt"] == timestamp(T0 + 5)
    reverted = pods.step(step.record, T0 + 6, desired=Settings(OLD.values, OLD.hash, 3))
    assert reverted.record is not None and reverted.record["phase"] == SUPERSEDED
    assert _groups(reverted) == {"old-hash": ["b", "c"]}


def test_strategy_all_pushes_everything_at_once() -> None:
    pods = Pods("a", "b")
    step = pods.step({}, T0, RolloutSpec())
    assert (_groups(step), step.config_map, step.record) == ({"new-hash": ["a", "b"]}, NEW, None)


def test_the_status_patch_drops_what_the_new_record_lacks() -> None:
    old = {"phase": ROLLED_BACK, "rejectedHash": "h", "windowStart": {"a": {}, "b": {}}}
    new = {"phase": BAKING, "windowStart": {"b": {}}}
    assert replacing(old, new) == {
        "phase": BAKING, "windowStart": {"b": {}, "a": None}, "rejectedHash": None,
    }  # fmt: skip
    assert replacing(old, None) is None and replacing(None, new) == new


def _through_the_api_server(value: Any) -> Any:
    """A status as the API server gives it back after kopf's JSON merge patch: a null value
    deletes its key, and an integral float comes back an integer (Go's JSON)."""
    if isinstance(value, dict):
        return {k: _through_the_api_server(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_through_the_api_server(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def test_a_rollback_restores_the_stable_settings_exactly_and_the_record_shrinks() -> None:
    """Found by a new user: the stable settings kept in the status as a mapping came back
    with 2000.0 as 2000 and without their nulls; the rollback pushed (and wrote into the
    ConfigMap) those, whose hash was not the stable one, so going back to the stable
    settings later started a canary of identical settings."""
    stable = Settings({"max_num_seqs": 8, "max_waiting_per_tenant": None, "wait_ms": 2000.0},
                      "old-hash", 1)  # fmt: skip
    pods = Pods("a", "b")
    started = asyncio.run(plan(CANARY, NEW, stable, {}, pods.targets, pods.scrape, T0))
    record = _through_the_api_server(started.record)
    pods.ttft["a"] += [0.7, 0.7]
    pods.ttft["b"] += [0.05, 0.05]
    step = asyncio.run(plan(CANARY, NEW, stable, record, pods.targets, pods.scrape, T0 + 3))
    assert step.record is not None and step.record["phase"] == ROLLED_BACK
    assert step.config_map == stable and [p.settings for p in step.pushes] == [stable]
    assert "windowStart" not in step.record  # the window's counts go with the bake
    assert json.loads(step.record["stableSettings"]) == stable.values  # kept: see plan


def test_a_canary_whose_first_scrape_failed_is_judged_from_its_next_one() -> None:
    # Breaker finding: a canary whose /metrics was slow when the rollout began was left out of
    # every window, so the only canary never counted and the bake waited for traffic forever.
    pods = Pods("a", "b")
    good = pods.scrape

    async def slow_a(targets: list[PodTarget]) -> dict[str, gate.Snapshot | None]:
        return {**await good(targets), "a": None}

    pods.scrape = slow_a  # type: ignore[method-assign]
    record = _stored({}, pods.step({}, T0).record)
    assert record["windowPending"] == ["a"] and "a" not in record["windowStart"]
    pods.scrape = good  # type: ignore[method-assign]
    pods.ttft["a"] += [0.05]  # before a's window starts: not counted
    later = _stored(record, pods.step(record, T0 + 5).record)
    assert later["windowStart"]["a"] == _pod(0.05) and "windowPending" not in later
    pods.ttft["a"] += [0.05, 0.15]
    pods.ttft["b"] += [0.05, 0.15]
    done = pods.step(later, T0 + 10)
    assert done.record is not None and done.record["phase"] == PROMOTED


def _merged(target: Any, patch: Any) -> Any:
    """A JSON merge patch (RFC 7386) applied, as the API server applies kopf's."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merged(out.get(key), value)
    return out


def _stored(old: dict[str, Any], new: dict[str, Any] | None) -> dict[str, Any]:
    """``status.rollout`` after the operator's patch from ``old`` to ``new``."""
    assert new is not None
    stored: dict[str, Any] = _merged({"rollout": old}, {"rollout": replacing(old, new)})["rollout"]
    return stored


def test_a_pod_whose_first_scrape_failed_stays_left_out_through_the_status_patch() -> None:
    # Breaker finding: its start was None in windowStart, which the status merge patch deletes;
    # the next reconcile found no start and counted the pod's whole life in the window (a
    # canary's requests from before the change included).
    pods = Pods("a", "b")
    pods.ttft["a"] = [0.7] * 5  # before the rollout, on the old settings
    good = pods.scrape

    async def slow_a(targets: list[PodTarget]) -> dict[str, gate.Snapshot | None]:
        return {**await good(targets), "a": None}

    pods.scrape = slow_a  # type: ignore[method-assign]
    record = _stored({}, pods.step({}, T0).record)
    pods.scrape = good  # type: ignore[method-assign]
    pods.ttft["b"] += [0.05, 0.05]
    step = pods.step(record, T0 + 5)  # a answers again: its window starts now
    assert step.record is not None and step.record["phase"] == BAKING
    assert "not enough traffic: canaries 0" in step.record["message"]


@pytest.mark.parametrize(
    "edit",
    [
        {"canaryPods": None},
        {"canaryPods": "a"},
        {"startedAt": "yesterday"},
        {"windowStart": ["a"]},
        {"windowStart": {"a": {gate.TTFT: {"+Inf": "many"}}}},
        {"stableSettings": None},
        {"stableVersion": "one"},
    ],
)
def test_a_hand_edited_bake_record_starts_the_rollout_again(edit: dict[str, Any]) -> None:
    # Breaker finding: a malformed status.rollout of a bake raised on every reconcile (before
    # anything was applied), so the resource was stuck until someone cleared the status.
    pods = Pods("a", "b")
    record = pods.step({}, T0).record
    assert record is not None
    step = pods.step({**record, **edit}, T0 + 5)
    assert step.record is not None and step.record["phase"] == BAKING
    assert step.record["startedAt"] == timestamp(T0 + 5)
    assert _groups(step) == {"new-hash": ["a"], "old-hash": ["b"]} and step.config_map == OLD


def test_a_deleted_configmap_neither_promotes_a_bake_nor_brings_back_a_rejected_change() -> None:
    # Breaker finding: with no ConfigMap (deleted by hand) plan took it as "nothing to roll
    # from" and pushed the baking, or the rolled-back, settings to every pod and the ConfigMap.
    pods = Pods("a", "b")
    baking = pods.step({}, T0).record
    assert baking is not None
    step = asyncio.run(plan(CANARY, NEW, None, baking, pods.targets, pods.scrape, T0 + 1))
    assert step.record is not None and step.record["phase"] == BAKING
    assert _groups(step) == {"new-hash": ["a"], "old-hash": ["b"]} and step.config_map == OLD
    pods.ttft["a"] += [0.7, 0.7]
    pods.ttft["b"] += [0.05, 0.05]
    rejected = pods.step(baking, T0 + 3).record
    assert rejected is not None and rejected["phase"] == ROLLED_BACK
    step = asyncio.run(plan(CANARY, NEW, None, rejected, pods.targets, pods.scrape, T0 + 9))
    assert _groups(step) == {"old-hash": ["a", "b"]} and step.config_map == OLD


def test_a_canary_that_restarts_or_goes_unready_is_no_reason_to_pick_another() -> None:
    # Breaker finding: a change that crashes the engine took the canary out of the ready pods
    # (restarting), and the next reconcile made the next pod the canary, which crashed too:
    # the change walked through the fleet. An unready canary that still exists is waited for;
    # one whose containers restarted during the bake rolls the change back.
    pods = Pods("a", "b", "c")

    def step(record: dict[str, Any], ready: list[str], restarts: dict[str, int]) -> Step:
        targets = [t for t in pods.targets if t.name in ready]
        return asyncio.run(
            plan(CANARY, NEW, OLD, record, targets, pods.scrape, T0 + 5, restarts=restarts)
        )

    started = asyncio.run(
        plan(CANARY, NEW, OLD, {}, pods.targets, pods.scrape, T0, restarts={"a": 2, "b": 0, "c": 0})
    ).record
    assert started is not None and started["canaryPods"] == ["a"]
    unready = step(started, ["b", "c"], {"a": 2, "b": 0, "c": 0})
    assert unready.record == started and _groups(unready) == {"old-hash": ["b", "c"]}
    assert unready.condition is not None and unready.condition[1] == "WaitingForPods"
    crashed = step(started, ["b", "c"], {"a": 3, "b": 0, "c": 0})
    assert crashed.record is not None and crashed.record["phase"] == ROLLED_BACK
    assert "pod a restarted" in crashed.record["message"] and crashed.outcome == "rolled_back"
    assert _groups(crashed) == {"old-hash": ["b", "c"]} and crashed.config_map == OLD
    gone = step(started, ["b", "c"], {"b": 0, "c": 0})  # pod a deleted: new canaries
    assert gone.record is not None and gone.record["canaryPods"] == ["b"]


def test_a_null_stable_setting_survives_the_status_patch() -> None:
    # Breaker finding: stableSettings.max_waiting_per_tenant: null (no cap, the default) was
    # deleted by the status merge patch, so the rollback pushed the stable settings without it:
    # a PUT merges, and the canaries kept the rejected cap (never at the stable hash).
    old = Settings({"max_num_seqs": 8, "max_waiting_per_tenant": None}, "old-hash", 1)
    new = Settings({"max_num_seqs": 8, "max_waiting_per_tenant": 1}, "new-hash", 2)
    pods = Pods("a", "b")

    def step(record: dict[str, Any], now_s: float) -> Step:
        return asyncio.run(plan(CANARY, new, old, record, pods.targets, pods.scrape, now_s))

    record = _stored({}, step({}, T0).record)
    assert json.loads(record["stableSettings"])["max_waiting_per_tenant"] is None  # kept
    pods.ttft["a"] += [0.7, 0.7]
    pods.ttft["b"] += [0.05, 0.05]
    rolled_back = step(record, T0 + 3)
    assert _groups(rolled_back) == {"old-hash": ["a", "b"]}
    assert rolled_back.pushes[0].settings == old and rolled_back.config_map == old


def test_a_canary_not_yet_on_the_change_is_not_judged_as_one() -> None:
    # Breaker finding: a canary whose push failed (a 401 while the kubelet had not refreshed
    # a rotated admin token, a timeout) kept the stable settings, and the gate compared stable
    # with stable: the change was promoted without having run. A canary's window starts at
    # its first scrape that shows the change's hash (GET /load config_hash).
    pods = Pods("a", "b")
    hashes = {"a": OLD.hash, "b": OLD.hash}
    plain = pods.scrape

    async def scrape(targets: list[PodTarget]) -> dict[str, gate.Snapshot | None]:
        found = await plain(targets)
        return {n: {**s, gate.CONFIG: {hashes[n]: 1.0}} for n, s in found.items() if s}

    pods.scrape = scrape  # type: ignore[method-assign]
    record = _stored({}, pods.step({}, T0).record)
    assert gate.CONFIG not in record["windowStart"]["a"]  # not kept in the status
    pods.ttft["a"] += [0.05, 0.15]  # served on the stable settings: the push did not land
    pods.ttft["b"] += [0.05, 0.15]
    stale = _stored(record, pods.step(record, T0 + 20).record)
    assert stale["phase"] == BAKING and stale["windowPending"] == ["a"]
    hashes["a"] = NEW.hash  # the push landed
    landed = _stored(stale, pods.step(stale, T0 + 30).record)
    assert landed["phase"] == BAKING and "windowPending" not in landed
    pods.ttft["a"] += [0.05, 0.15]
    pods.ttft["b"] += [0.05, 0.15]
    done = pods.step(landed, T0 + 40).record
    assert done is not None and done["phase"] == PROMOTED
