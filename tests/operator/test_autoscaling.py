"""Autoscaling decisions, tested on simulated replicas: "test the decision, not the cluster".

Two simulated replicas (``iterserve serve --simulate``, ``max_num_seqs`` 2, so requests queue)
behind a router take an open-loop load that rises past what they absorb, holds, and stops.
Every tick the test scrapes each replica's and the router's ``/metrics`` the way Prometheus
would (with the ``namespace`` and ``pod`` labels the scrape attaches, pod names as a
Deployment gives them, and a decoy pod of another namespace), then computes what the
autoscalers read from exactly the queries they are given: the prometheus-adapter rule of
docs/autoscaling.md for the HPA's Pods metric, and the rendered ScaledObject's queries for
KEDA; and applies the HPA algorithm and KEDA's activation (tests/autoscaling_model.py) to a
simulated replica count. Time is compressed: one tick (0.2 s) is one 15 s sync period and
scrape interval, so the HPA's 300 s scale-down window is 20 ticks and the wake query's [1m]
window 4 scrapes. A last scenario is scale to zero: a router with no ready replica, one
request, its 503 counted and the computed rate waking the deployment.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from autoscaling_model import (
    SYNC_PERIOD_S,
    Hpa,
    Keda,
    Store,
    Trigger,
    evaluate,
    external_proposal,
    extrapolated_rate,
    pods_proposal,
    scalar_of,
)
from prometheus_client.parser import text_string_to_metric_families
from router_utils import router, until
from server_utils import Server, run_server
from sim_profiles import make_profile, write_profile

from iterserve.operator.builders import QUEUE_METRIC, WAKE_WINDOW, Context, autoscaler
from iterserve.operator.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]
NAME, NS = "chat-70b", "serving"
PODS = [f"{NAME}-7d9f8c6b5-x2k9p", f"{NAME}-7d9f8c6b5-m4q7z"]  # as the Deployment names them
ROUTER_POD = f"{NAME}-router-5c8d7f9b4-qw8rt"
DECOY = {"namespace": "other", "pod": f"{NAME}-7d9f8c6b5-zzzzz"}  # same name, other namespace
PORTS = (18600, 18601)
DEAD_PORT = 18699  # nothing listens: a replica that is not ready
TARGET = 5  # targetQueueDepth: waiting requests per pod
MAX_REPLICAS = 8
TICK_S = 0.2  # wall seconds per sync period / scrape (SYNC_PERIOD_S of cluster time)
# The load, in requests per wall second: a ramp past what two replicas serve (~11/s), a
# plateau, then nothing.
RISE_S, PEAK_S, PEAK_RATE, BASE_RATE = 2.0, 2.0, 24.0, 2.0
MAX_TOKENS = 16  # ~16 iterations of ~22 ms: ~0.35 s per request, 2 at a time per replica


def _spec(**autoscaling: Any) -> Any:
    example = yaml.safe_load((Path(__file__).parent / "examples" / "chat-70b.yaml").read_text())
    example["spec"]["autoscaling"] = {
        "enabled": True,
        "maxReplicas": MAX_REPLICAS,
        "targetQueueDepth": TARGET,
        **autoscaling,
    }
    return parse_spec(example["spec"])


def _autoscaler(picker: bool = False, **autoscaling: Any) -> dict[str, Any]:
    spec = _spec(**autoscaling)
    if picker:
        spec = spec.model_copy(
            update={"router": spec.router.model_copy(update={"mode": "endpointPicker"})}
        )
    built = autoscaler(Context(NAME, NS), spec)
    assert built is not None
    return built


def doc_blocks() -> list[Any]:
    """The YAML blocks of docs/autoscaling.md."""
    text = (ROOT / "docs" / "autoscaling.md").read_text()
    return [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S)]


def adapter_rule() -> dict[str, Any]:
    """The prometheus-adapter rule docs/autoscaling.md gives (its ``rules.custom`` block)."""
    blocks = doc_blocks()
    (rules,) = [b["rules"]["custom"] for b in blocks if isinstance(b, dict) and "rules" in b]
    (rule,) = rules
    return dict(rule)


def adapter_values(rule: dict[str, Any], store: Store, t: float, pods: list[str]) -> list[float]:
    """What the custom metrics API answers the HPA for ``pods`` (in namespace NS), as the
    adapter computes it: the metricsQuery template filled as the adapter fills it."""
    series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"])
    assert series is not None
    matchers = f'namespace="{NS}",pod=~"{"|".join(pods)}"'
    query = (
        rule["metricsQuery"]
        .replace("<<.Series>>", series[0])
        .replace("<<.LabelMatchers>>", matchers)
        .replace("<<.GroupBy>>", "pod")
    )
    result = evaluate(query, store, t)
    assert isinstance(result, dict)
    by_pod = {dict(labels)["pod"]: value for labels, value in result.items()}
    return [by_pod[p] for p in pods if p in by_pod]


def _scrape(store: Store, t: float, text: str, labels: dict[str, str]) -> None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            store.add(t, sample.name, {**sample.labels, **labels}, sample.value)


# -- the model's parts, against what their sources document --------------------------------


def test_hpa_formula_documented_examples() -> None:
    """Kubernetes' "Algorithm details": 200m against 100m doubles, 50m halves, a ratio within
    0.1 of 1 changes nothing; the configurable-tolerance post's 50 pods at 90 against 75 -> 60."""
    assert pods_proposal([0.2] * 3, 0.1, 3) == 6
    assert pods_proposal([0.05] * 4, 0.1, 4) == 2
    assert pods_proposal([1.05] * 4, 1.0, 4) == 4  # within the tolerance
    assert pods_proposal([0.91] * 4, 1.0, 4) == 4
    assert pods_proposal([1.2] * 4, 1.0, 4) == 5  # ceil(4.8)
    assert pods_proposal([90.0] * 50, 75.0, 50) == 60
    # The average over the pods that report: 2 pods with 9 and 3 waiting at target 3 -> 4.
    assert pods_proposal([9.0, 3.0], 3.0, 2) == 4
    # An External AverageValue metric (KEDA's triggers): ceil(value / target), the tolerance
    # on the value per current replica.
    assert external_proposal(20.0, 5.0, 3) == 4  # KEDA's docs: 20 messages, threshold 5 -> 4
    assert external_proposal(6.2, 2.0, 3) == 3  # 6.2 / (2 * 3) within 0.1 of 1
    assert external_proposal(0.0, 2.0, 3) == 0


def test_hpa_stabilisation_windows_and_limits() -> None:
    """Scale-up window 0: at once (up to the default +4 pods or +100% per period); scale-down:
    the highest recommendation of the window (20 periods of 15 s = 300 s); min/max clamp."""
    hpa = Hpa(min_replicas=1, max_replicas=8, replicas=1, scale_down_window_s=300)
    t = 0.0
    assert hpa.step(t, [3]) == 3  # up at once
    t += SYNC_PERIOD_S
    assert hpa.step(t, [20]) == 7  # +4 pods (more than +100% of 3) per period
    t += SYNC_PERIOD_S
    assert hpa.step(t, [20]) == 8  # max
    high = t
    counts = []
    while t < high + 300 + 2 * SYNC_PERIOD_S:
        t += SYNC_PERIOD_S
        counts.append(hpa.step(t, [0]))
    # The 20 recommendation stays in the window for 300 s (19 more syncs), then min.
    assert counts == [8] * 19 + [1] * (len(counts) - 19)
    hpa = Hpa(min_replicas=2, max_replicas=4, replicas=3, scale_down_window_s=0)
    assert hpa.step(0.0, [0]) == 2  # no window: down at once, to min


def test_keda_activation_is_strictly_above_the_threshold() -> None:
    """Active only above activationThreshold (0 is not above 0); 0 -> 1 on activation; back to
    0 when no trigger has been active for cooldownPeriod."""
    so = _autoscaler(via="keda", minReplicas=0, prometheusURL="http://prometheus:9090")
    keda = Keda.of(so, replicas=0)
    wake = [Trigger(threshold=1.0, activation_threshold=0.0)]
    assert keda.step(0.0, [0.0], wake) == 0
    assert keda.step(15.0, [0.001], wake) == 1
    assert keda.step(30.0, [0.0], wake) == 1
    assert keda.step(15.0 + 300 - 15, [0.0], wake) == 1
    assert keda.step(15.0 + 300, [0.0], wake) == 0


def test_prometheus_rate_extrapolation() -> None:
    """A steady counter sampled every 15 s over [1m] gives its slope; Prometheus does not
    extrapolate before a counter's zero point; a counter reset is an increase from 0; a series
    whose first sample is already 1 has no increase (why the router exports its 503 series at 0
    from the start)."""
    steady = [(15.0, 100.0), (30.0, 101.0), (45.0, 102.0), (60.0, 103.0)]
    assert extrapolated_rate(steady, 0.0, 60.0) == pytest.approx(1 / 15)
    from_zero = [(5.0, 0.0), (20.0, 1.0), (35.0, 2.0), (50.0, 3.0)]
    assert extrapolated_rate(from_zero, -10.0, 50.0) == pytest.approx(3 * 45 / 45 / 60)
    reset = [(15.0, 10.0), (30.0, 11.0), (45.0, 1.0), (60.0, 2.0)]
    assert extrapolated_rate(reset, 0.0, 60.0) == pytest.approx(3 * 60 / 45 / 60)
    store = Store()
    for t in (15.0, 30.0, 45.0, 60.0):
        store.add(t, "c_total", {"pod": "p"}, 1.0)
    assert evaluate("sum(rate(c_total[1m]))", store, 60.0) == {frozenset(): 0.0}


def test_adapter_rule_serves_the_hpa_metric_per_pod() -> None:
    """The rule in docs/autoscaling.md exposes the HPA's metric under its own name, for pods
    and namespaces, and its query gives each asked-for pod its own value (not another
    namespace's pod of the same name, not a pod that was not asked for)."""
    rule = adapter_rule()
    hpa = _autoscaler(via="hpa")
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert name == QUEUE_METRIC
    matches, exposed = rule["name"]["matches"], rule["name"]["as"]
    assert re.sub(matches, exposed.replace("${1}", r"\1"), QUEUE_METRIC) == name
    assert rule["resources"]["overrides"] == {
        "namespace": {"resource": "namespace"},
        "pod": {"resource": "pod"},
    }
    store = Store()
    for pod, value in ((PODS[0], 4.0), (PODS[1], 1.0), ("elsewhere-1-a", 7.0)):
        store.add(0.0, QUEUE_METRIC, {"namespace": NS, "pod": pod}, value)
    store.add(0.0, QUEUE_METRIC, DECOY, 100.0)
    assert adapter_values(rule, store, 0.0, PODS) == [4.0, 1.0]
    discovered = evaluate(rule["seriesQuery"], store, 0.0)
    assert isinstance(discovered, dict) and len(discovered) == 4


def test_the_documented_scaled_object_and_wake_trigger_are_the_rendered_ones() -> None:
    blocks = doc_blocks()
    (documented,) = [b for b in blocks if isinstance(b, dict) and b.get("kind") == "ScaledObject"]
    (wake,) = [b[0] for b in blocks if isinstance(b, list) and b[0].get("name") == "wake"]
    url = "http://prometheus.monitoring.svc:9090"
    rendered = autoscaler(
        Context(NAME, NS),
        _spec(via="keda", minReplicas=1, maxReplicas=8, targetQueueDepth=8, prometheusURL=url),
    )
    assert rendered is not None and documented["spec"] == rendered["spec"]
    to_zero = _autoscaler(via="keda", minReplicas=0, prometheusURL=url)
    assert wake == to_zero["spec"]["triggers"][1]


def test_wake_query_is_clamped_to_one_replica() -> None:
    """The wake trigger reads the router pods' request rate, clamped to 1: with threshold 1
    it proposes 1 replica at any rate (the queue trigger scales out), 0 without requests; the
    router pods of another deployment or namespace do not count."""
    so = _autoscaler(via="keda", minReplicas=0, prometheusURL="http://prometheus:9090")
    _, wake = so["spec"]["triggers"]
    store = Store()
    name = "iterserve_router_requests_total"
    window_end = 15.0 * WAKE_TICKS  # the first evaluation with a whole window of samples
    for i in range(WAKE_TICKS + 1):
        t = 15.0 * i
        labels = {"replica": "none", "code": "503", "namespace": NS}
        store.add(t, name, {**labels, "pod": ROUTER_POD}, 50.0 * i)  # 3.3 requests/s
        store.add(t, name, {**labels, "pod": f"{NAME}-router-5c8d7f9b4-zx81k"}, 0.0)
        store.add(t, name, {**labels, "pod": "other-router-5c8d7f9b4-qw8rt"}, 900.0 * i)
        store.add(t, name, {**labels, "namespace": "other", "pod": ROUTER_POD}, 900.0 * i)
    assert scalar_of(evaluate(wake["metadata"]["query"], store, window_end)) == 1.0
    assert external_proposal(1.0, float(wake["metadata"]["threshold"]), 5) == 1
    unclamped = wake["metadata"]["query"].removeprefix("clamp_max(").removesuffix(", 1)")
    assert scalar_of(evaluate(unclamped, store, window_end)) == pytest.approx(50 / 15)


def test_requests_held_before_any_answer_wake_the_deployment() -> None:
    """A router at zero server pods holds requests and counts them only once answered (up to
    its hold timeout later): the held-requests gauge alone activates the wake trigger, at one
    replica however many are held; held requests of another deployment's router do not
    count, and without either series the trigger reads 0 (not an empty result)."""
    so = _autoscaler(via="keda", minReplicas=0, prometheusURL="http://prometheus:9090")
    _, wake = so["spec"]["triggers"]
    query = wake["metadata"]["query"]
    store = Store()
    assert evaluate(query, store, 0.0) == {frozenset(): 0.0}
    held = "iterserve_router_held_requests"
    store.add(0.0, held, {"namespace": NS, "pod": "other-router-5c8d7f9b4-qw8rt"}, 7.0)
    assert scalar_of(evaluate(query, store, 0.0)) == 0.0
    store.add(15.0, held, {"namespace": NS, "pod": ROUTER_POD}, 3.0)
    assert scalar_of(evaluate(query, store, 15.0)) == 1.0
    keda = Keda.of(so, replicas=0)
    trigger = Trigger(float(wake["metadata"]["threshold"]), 0.0)
    assert keda.step(15.0, [0.0, 1.0], [trigger, trigger]) == 1


def test_picker_mode_wakes_on_the_pickers_pods() -> None:
    """In endpointPicker mode the requests reach the picker pods (N-epp-...), not a router."""
    so = _autoscaler(via="keda", minReplicas=0, prometheusURL="http://prometheus:9090", picker=True)
    _, wake = so["spec"]["triggers"]
    store = Store()
    held = "iterserve_router_held_requests"
    store.add(0.0, held, {"namespace": NS, "pod": ROUTER_POD}, 2.0)
    assert scalar_of(evaluate(wake["metadata"]["query"], store, 0.0)) == 0.0
    store.add(15.0, held, {"namespace": NS, "pod": f"{NAME}-epp-5c8d7f9b4-zx81k"}, 2.0)
    assert scalar_of(evaluate(wake["metadata"]["query"], store, 15.0)) == 1.0


# -- the decision under a rising and falling load ------------------------------------------


@dataclass
class Recording:
    """Scrapes at cluster times ``times`` (one per tick) and what the load did."""

    store: Store = field(default_factory=Store)
    times: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)  # offered load at each tick, req/s
    codes: list[int] = field(default_factory=list)
    load_end_tick: int = 0


def _offered_rate(elapsed_s: float) -> float:
    if elapsed_s < RISE_S:
        return BASE_RATE + (PEAK_RATE - BASE_RATE) * elapsed_s / RISE_S
    if elapsed_s < RISE_S + PEAK_S:
        return PEAK_RATE
    return 0.0


def _offered_requests(elapsed_s: float) -> float:
    """The requests due after ``elapsed_s`` (the offered rate's integral): an open loop sends
    them whatever the answers do."""
    rise = min(elapsed_s, RISE_S)
    due = BASE_RATE * rise + (PEAK_RATE - BASE_RATE) * rise**2 / (2 * RISE_S)
    return due + PEAK_RATE * min(max(0.0, elapsed_s - RISE_S), PEAK_S)


# The wake query's rate window in ticks (scrapes).
WAKE_TICKS = int(WAKE_WINDOW.removesuffix("m")) * 60 // int(SYNC_PERIOD_S)
# After the last answer: the wake query's rate window, KEDA's cooldown and the HPA's
# scale-down window (20 periods each), and a margin.
TAIL_TICKS = WAKE_TICKS + int(300 / SYNC_PERIOD_S) + 3


async def _record(urls: list[str], router_url: str, recording: Recording) -> None:
    """Scrape every tick; send the open-loop load; go on for TAIL_TICKS after the last
    answer."""
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=500)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:

        async def scrape(tick: int) -> None:
            t = tick * SYNC_PERIOD_S
            texts = await asyncio.gather(*(http.get(u + "/metrics") for u in [*urls, router_url]))
            for pod, response in zip([*PODS, ROUTER_POD], texts, strict=True):
                _scrape(recording.store, t, response.text, {"namespace": NS, "pod": pod})
            _scrape(recording.store, t, texts[0].text, DECOY)  # counts only if unfiltered
            recording.times.append(t)

        async def one(i: int) -> None:
            body = {"model": "Test-Model", "prompt": f"request {i}", "max_tokens": MAX_TOKENS}
            body["ignore_eos"] = True
            response = await http.post(router_url + "/v1/completions", json=body)
            recording.codes.append(response.status_code)

        for tick in range(3):  # idle before the load
            await scrape(tick)
            await asyncio.sleep(TICK_S)
        requests: list[asyncio.Task[None]] = []
        start = time.monotonic()
        tick, next_scrape = 3, start
        while (elapsed := time.monotonic() - start) < RISE_S + PEAK_S:
            if time.monotonic() >= next_scrape:
                await scrape(tick)
                recording.rates.append(_offered_rate(elapsed))
                tick, next_scrape = tick + 1, next_scrape + TICK_S
            while len(requests) < math.floor(_offered_requests(elapsed)):
                requests.append(asyncio.create_task(one(len(requests))))
            await asyncio.sleep(0.01)
        recording.load_end_tick = tick
        tail = TAIL_TICKS
        while tail:
            await asyncio.sleep(max(0.0, next_scrape - time.monotonic()))
            await scrape(tick)
            tick, next_scrape = tick + 1, next_scrape + TICK_S
            if all(r.done() for r in requests):
                tail -= 1
        await asyncio.gather(*requests)


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recording]:
    profile = write_profile(
        tmp_path_factory.mktemp("autoscaling") / "profile.json", make_profile(fixed_s=0.020)
    )
    flags = ("--simulate", str(profile), "--max-num-seqs", "2")
    with contextlib.ExitStack() as stack:
        servers: list[Server] = [
            stack.enter_context(run_server(*flags, port=port, startup_timeout_s=60))
            for port in PORTS
        ]
        result = Recording()

        async def run() -> None:
            backends = [x for s in servers for x in ("--backend", s.url)]
            async with router(*backends) as (url, app):
                pool = app.state.router["pool"]
                await until(lambda: len(pool.ready()) == len(servers), "replicas ready")
                await _record([s.url for s in servers], url, result)

        asyncio.run(run())
        yield result


def _queue_values(recording: Recording) -> list[list[float]]:
    """Each tick's per-pod waiting requests, as the adapter serves them to the HPA."""
    rule = adapter_rule()
    return [adapter_values(rule, recording.store, t, PODS) for t in recording.times]


def test_the_load_queues_then_drains(recording: Recording) -> None:
    assert recording.codes and set(recording.codes) == {200}
    per_pod = _queue_values(recording)
    assert all(len(values) == len(PODS) for values in per_pod)  # every pod reports
    average = [sum(v) / len(v) for v in per_pod]
    assert average[:3] == [0.0] * 3  # idle before the load
    assert max(average) > TARGET  # past what the replicas absorb
    assert average[-1] == 0.0  # drained after it


def test_hpa_scales_up_in_the_peak_and_down_after_the_window(recording: Recording) -> None:
    hpa_object = _autoscaler(via="hpa", minReplicas=1)
    spec = hpa_object["spec"]
    (metric,) = spec["metrics"]
    target = float(metric["pods"]["target"]["averageValue"])
    window_s = spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"]
    hpa = Hpa(
        spec["minReplicas"],
        spec["maxReplicas"],
        replicas=spec["minReplicas"],
        scale_up_window_s=spec["behavior"]["scaleUp"]["stabilizationWindowSeconds"],
        scale_down_window_s=window_s,
    )
    per_pod = _queue_values(recording)
    average = [sum(v) / len(v) for v in per_pod]
    proposals, counts = [], []
    for t, values in zip(recording.times, per_pod, strict=True):
        # The metric averages over the pods that report (the recorded ones).
        proposals.append(pods_proposal(values, target, hpa.replicas))
        counts.append(hpa.step(t, [proposals[-1]]))
    _print_table(recording, average, counts)
    window = int(window_s / SYNC_PERIOD_S)
    assert counts[:3] == [1] * 3  # min while idle
    # Scale-up window 0: at the first sync clearly above the target the count already is
    # what the metric asks for (a window would hold it at the lowest recent recommendation).
    crossing = next(i for i, a in enumerate(average) if a > target * 1.1)
    assert counts[crossing] >= math.ceil(len(PODS) * average[crossing] / target) > 1
    assert max(counts) >= 3
    peak = counts.index(max(counts))
    # Above the target until the load stops, under it soon after (the queue drains).
    end = recording.load_end_tick
    assert average[end - 1] > target
    last_above = max(i for i, a in enumerate(average) if a > target)
    assert peak <= last_above < end + 25
    # What the last sync above the target asked for holds for the whole window, then min.
    held = range(last_above, last_above + window)
    assert all(counts[i] >= proposals[last_above] > 1 for i in held)
    drained = next(i for i in range(last_above, len(average)) if average[i] == 0.0)
    assert counts[drained + window] == 1 and counts[-1] == 1


def test_keda_wakes_on_the_router_scales_on_the_queue_and_sleeps(recording: Recording) -> None:
    so = _autoscaler(via="keda", minReplicas=0, prometheusURL="http://prometheus:9090")
    queue, wake = so["spec"]["triggers"]
    triggers = [
        Trigger(float(tr["metadata"]["threshold"]), float(tr["metadata"]["activationThreshold"]))
        for tr in (queue, wake)
    ]
    keda = Keda.of(so, replicas=0)
    sums, rates, counts = [], [], []
    for t in recording.times:
        values = [
            scalar_of(evaluate(tr["metadata"]["query"], recording.store, t)) for tr in (queue, wake)
        ]
        sums.append(values[0])
        rates.append(values[1])
        counts.append(keda.step(t, values, triggers))
    print("\ntick  queue sum  wake rate  KEDA replicas")
    for i, (q, r, c) in enumerate(zip(sums, rates, counts, strict=True)):
        print(f"{i:4d}  {q:9.1f}  {r:9.3f}  {c:13d}")
    per_pod = _queue_values(recording)
    assert sums == [sum(v) for v in per_pod]  # the sum over the model's pods, no decoy
    assert counts[:3] == [0] * 3 and rates[:3] == [0.0] * 3
    # Activated by the first trigger above 0 (the router's rate or, the fleet being up here,
    # the queue), to one replica.
    first = next(i for i in range(len(rates)) if rates[i] > 0 or sums[i] > 0)
    assert 3 <= first < recording.load_end_tick and counts[first] == 1
    woken = next(i for i, r in enumerate(rates) if r > 0)
    assert all(r > 0 for r in rates[woken : recording.load_end_tick + 1])
    assert max(sums) > TARGET * 2 and max(counts) >= 3  # the queue trigger scales out
    assert max(rates) <= 1.0  # clamped (test_wake_query_is_clamped_to_one_replica)
    last_active = max(i for i in range(len(rates)) if rates[i] > 0 or sums[i] > 0)
    cooldown = int(so["spec"]["cooldownPeriod"] / SYNC_PERIOD_S)
    assert all(c >= 1 for c in counts[first : last_active + cooldown])
    assert counts[last_active + cooldown :] and set(counts[last_active + cooldown :]) == {0}


def _print_table(recording: Recording, average: list[float], counts: list[int]) -> None:
    """Shown with ``pytest -s`` (the figures in docs/autoscaling.md)."""
    rates = [0.0] * 3 + recording.rates
    rates += [0.0] * (len(average) - len(rates))
    print("\ntick  offered req/s  avg waiting  HPA replicas")
    for i, (r, a, c) in enumerate(zip(rates, average, counts, strict=True)):
        print(f"{i:4d}  {r:13.1f}  {a:11.1f}  {c:12d}")


# -- scale to zero: the router's 503s wake it ---------------------------------------------


HOLD_TIMEOUT_S = 3.0  # the router's --hold-timeout-s here (60 s by default)


def test_one_request_held_by_a_router_with_no_ready_replica_wakes_the_deployment() -> None:
    """A real router with no ready replica holds the request: the next scrape, while it is
    still held, already wakes the deployment (its arrival is counted at once, and the
    held-requests gauge reads 1); past the hold it gets 503 with Retry-After, and the wake
    trigger stays active until the request leaves the rate's window."""
    so = _autoscaler(via="keda", minReplicas=0, prometheusURL="http://prometheus:9090")
    queue, wake = so["spec"]["triggers"]
    triggers = [
        Trigger(float(tr["metadata"]["threshold"]), float(tr["metadata"]["activationThreshold"]))
        for tr in (queue, wake)
    ]
    keda = Keda.of(so, replicas=0)
    store = Store()
    counts: list[int] = []
    rates: list[float] = []
    held: list[float] = []

    async def run() -> None:
        dead = f"http://127.0.0.1:{DEAD_PORT}"
        flags = ("--backend", dead, "--hold-timeout-s", str(HOLD_TIMEOUT_S))
        async with router(*flags) as (url, _), httpx.AsyncClient(timeout=30) as http:

            async def tick(i: int) -> None:
                t = i * SYNC_PERIOD_S
                metrics = (await http.get(url + "/metrics")).text
                _scrape(store, t, metrics, {"namespace": NS, "pod": ROUTER_POD})
                values = [
                    scalar_of(evaluate(tr["metadata"]["query"], store, t)) for tr in (queue, wake)
                ]
                rates.append(values[1])
                counts.append(keda.step(t, values, triggers))
                gauge = evaluate("sum(iterserve_router_held_requests)", store, t)
                held.append(scalar_of(gauge))

            for i in range(4):
                await tick(i)
            started = time.monotonic()
            request = asyncio.create_task(http.post(url + "/v1/completions", json={"prompt": "hi"}))
            while (
                "iterserve_router_held_requests 1.0" not in (await http.get(url + "/metrics")).text
            ):
                assert time.monotonic() - started < HOLD_TIMEOUT_S, "the request was not held"
                await asyncio.sleep(0.02)
            await tick(4)  # while it is held
            assert not request.done()
            answer = await request
            assert time.monotonic() - started >= HOLD_TIMEOUT_S * 0.9
            assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
            assert "no ready replica" in answer.json()["error"]["message"]
            for i in range(5, 4 + WAKE_TICKS + 3):
                await tick(i)

    asyncio.run(run())
    assert counts[:4] == [0] * 4 and rates[:4] == [0.0] * 4
    assert held[4] == 1.0 and rates[4] == 1.0 and counts[4] == 1  # woken while held
    assert held[5:] == [0.0] * (WAKE_TICKS + 2)
    # The request (held, then answered 503) leaves the rate window: inactive again, still 1
    # replica until the cooldown.
    assert all(r > 0 for r in rates[4 : 4 + WAKE_TICKS - 1])
    assert rates[-2:] == [0.0] * 2 and counts[4:] == [1] * (WAKE_TICKS + 3)
