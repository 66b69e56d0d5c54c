"""The chart's Grafana dashboard and PrometheusRule against what iterserve really exports.

The chart is rendered with ``helm template``; every PromQL expression of the dashboard and the
rules is parsed with promql-parser, and every series it selects must exist on a running
simulated replica or on the router in front of it (after a few requests, so the labelled series
exist), with every label the expression matches, groups or joins on. The alerts' conditions are
then checked on those processes where that needs no Prometheus: the tier limits the queue-wait
alert compares with follow a live config change, the prefill-stall selectors count an iteration
over the ceiling (and stop after the runbook's fix), and the KV-leak alert's gauge ignores
prefix-cached blocks.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import promql_parser as pp
import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import Server, run_server
from sim_profiles import make_profile, write_profile

from iterserve.operator.builders import pod_regex, router_name
from iterserve.operator.metrics import OperatorMetrics

# Labels Prometheus attaches when it scrapes (PodMonitor / ServiceMonitor targets and the
# prometheus.io annotation jobs alike); the processes cannot export them.
TARGET_LABELS = frozenset({"namespace", "pod", "job", "instance"})
LLMD = "chat"  # the LLMDeployment the dashboard's variables select here
GRAFANA_VARS = {
    "$__rate_interval": "1m", "$__range": "1h", "$namespace": "serving", "$llmdeployment": LLMD,
}  # fmt: skip
REPLICA_PORT, ROUTER_PORT, DEAD_PORT = 18500, 18501, 18599  # nothing listens on DEAD_PORT
ADMIN = {"Authorization": "Bearer obs-admin"}
TIERS = [
    {"name": "premium", "priority": 0, "max_queue_wait_ms": 500},
    {"name": "standard", "priority": 1, "max_queue_wait_ms": 2000},
    {"name": "best-effort", "priority": 2},
]
Series = dict[str, frozenset[str]]  # sample name -> the label names it carries
CHART = Path(__file__).resolve().parents[2] / "charts" / "iterserve"


# ----------------------------------------------------------------- rendering


def render(
    helm: Path, *values: str, set_json: str | None = None, release: tuple[str, str] | None = None
) -> dict[str, list[Any]]:
    """``helm template`` of the chart with ``--set`` of each of ``values`` (as the release
    ``(name, namespace)``, else helm's default): objects by kind."""
    flags = [f for v in values for f in ("--set", v)]
    flags += ["--set-json", set_json] if set_json else []
    name = [release[0], "-n", release[1]] if release else []
    out = subprocess.run(
        [str(helm), "template", *name, str(CHART), *flags],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    objects: dict[str, list[dict[str, Any]]] = {}
    for doc in yaml.safe_load_all(out):
        if doc:
            objects.setdefault(doc["kind"], []).append(doc)
    return objects


@pytest.fixture(scope="module")
def rendered(helm: Path) -> dict[str, list[dict[str, Any]]]:
    # As docs/observability.md installs it: helm template charts/iterserve
    # --set dashboard.enabled=true --set alerts.enabled=true
    return render(helm, "dashboard.enabled=true", "alerts.enabled=true")


@pytest.fixture(scope="module")
def dashboard(rendered: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    (config_map,) = [c for c in rendered["ConfigMap"] if "iterserve.json" in c.get("data", {})]
    return json.loads(config_map["data"]["iterserve.json"])  # type: ignore[no-any-return]


def alert_rules(objects: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    (rule,) = objects["PrometheusRule"]
    return {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows hold theirs


def grafana_to_promql(expr: str) -> str:
    for name, value in GRAFANA_VARS.items():
        expr = expr.replace("${" + name[1:] + "}", value).replace(name, value)
    assert "$" not in expr.replace('"$1"', ""), f"unsubstituted variable in {expr}"
    return expr


def dashboard_queries(dashboard: dict[str, Any]) -> dict[str, str]:
    """Every PromQL expression of the dashboard, variables substituted: {where: expr}."""
    queries = {}
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            queries[f"panel {panel['title']!r} {target['refId']}"] = grafana_to_promql(
                target["expr"]
            )
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            queries[f"variable {var['name']}"] = grafana_to_promql(variable_expr(var))
    return queries


def variable_expr(var: dict[str, Any]) -> str:
    """The PromQL a query variable runs: query_result(EXPR) runs EXPR;
    label_values(SELECTOR, LABEL) reads LABEL of SELECTOR's series."""
    query = var["query"]["query"]
    assert var["definition"] == query
    if m := re.fullmatch(r"query_result\((.+)\)", query, re.S):
        assert var["query"]["qryType"] == 3  # Grafana's PromVariableQueryType.VarQueryResult
        return m[1]
    m = re.fullmatch(r"label_values\((.+), *(\w+)\)", query)
    assert m, var["query"]
    return f"count by ({m[2]}) ({m[1]})"


def query_result_line(labels: dict[str, str], value: float = 1.0) -> str:
    """One result of a query_result variable as Grafana's Prometheus data source writes it for
    the variable's regex: ``NAME{k="v",...} VALUE TIMESTAMP_MS`` (no name after an aggregation)."""
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{{{inner}}} {value:g} 1700000000000"


# ----------------------------------------------------------------- PromQL's labels


def result_labels(node: Any, series: Series, errors: list[str]) -> frozenset[str] | None:
    """The label names ``node``'s result can carry (None: a scalar or a string), given the
    exported ``series``; every selector, matcher, grouping and join label that does not exist
    is appended to ``errors``."""

    def check(labels: Any, have: frozenset[str], where: str) -> None:
        for label in labels:
            if label not in have:
                errors.append(f"{where}: label {label!r} not on {sorted(have)}")

    if isinstance(node, pp.VectorSelector):
        if node.name not in series:
            errors.append(f"{node.name}: no such series")
            return TARGET_LABELS
        have = series[node.name] | TARGET_LABELS
        check([m.name for m in node.matchers.matchers], have, f"{node.name}{{...}}")
        return have
    if isinstance(node, pp.MatrixSelector):
        return result_labels(node.vector_selector, series, errors)
    if isinstance(node, pp.ParenExpr | pp.UnaryExpr | pp.SubqueryExpr):
        return result_labels(node.expr, series, errors)
    if isinstance(node, pp.NumberLiteral | pp.StringLiteral):
        return None
    if isinstance(node, pp.Call):
        args = [result_labels(a, series, errors) for a in node.args]
        name = node.func.name
        if name == "label_replace":
            assert args[0] is not None
            check([node.args[3].val], args[0], "label_replace source")
            return args[0] | {node.args[1].val}
        if name == "histogram_quantile":
            assert args[1] is not None
            check(["le"], args[1], "histogram_quantile")
            return args[1] - {"le"}
        vectors = [a for a in args if a is not None]
        return vectors[0] if vectors else frozenset()
    if isinstance(node, pp.AggregateExpr):
        inner = result_labels(node.expr, series, errors)
        assert inner is not None
        if node.modifier is None:
            return frozenset()
        if node.modifier.type == pp.AggModifierType.By:
            check(node.modifier.labels, inner, "by")
            return frozenset(node.modifier.labels)
        return inner - set(node.modifier.labels)
    if isinstance(node, pp.BinaryExpr):
        lhs = result_labels(node.lhs, series, errors)
        rhs = result_labels(node.rhs, series, errors)
        if lhs is None or rhs is None:
            return lhs if rhs is None else rhs
        mod = node.modifier
        if mod is not None and mod.matching is not None:
            if mod.matching.type == pp.LabelModifierType.Include:
                check(mod.matching.labels, lhs, "on (left side)")
                check(mod.matching.labels, rhs, "on (right side)")
            if mod.card == pp.VectorMatchCardinality.ManyToOne:
                check(mod.group_labels, rhs, "group_left")
                return lhs | set(mod.group_labels)
            if mod.card == pp.VectorMatchCardinality.OneToMany:
                check(mod.group_labels, lhs, "group_right")
                return rhs | set(mod.group_labels)
        return lhs
    raise AssertionError(f"unhandled PromQL node {type(node).__name__}: {node}")


def selectors(expr: str) -> list[Any]:
    found: list[Any] = []
    pp.walk(pp.parse(expr), lambda n: found.append(n) if isinstance(n, pp.VectorSelector) else None)
    return found


# ----------------------------------------------------------------- the processes


def scrape(url: str) -> list[Any]:
    """The samples of ``url``/metrics."""
    text = httpx.get(url + "/metrics", timeout=5).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def series_of(samples: list[Any]) -> Series:
    out: dict[str, set[str]] = {}
    for s in samples:
        out.setdefault(s.name, set()).update(s.labels)
    return {name: frozenset(labels) for name, labels in out.items()}


def selected(selector: Any, samples: list[Any]) -> list[Any]:
    """The samples a PromQL selector picks (equality and regex matchers; PromQL anchors)."""

    def matches(m: Any, value: str) -> bool:
        if m.op == pp.MatchOp.Equal:
            return bool(value == m.value)
        if m.op == pp.MatchOp.NotEqual:
            return bool(value != m.value)
        found = re.fullmatch(m.value, value) is not None
        return found if m.op == pp.MatchOp.Re else not found

    return [
        s
        for s in samples
        if s.name == selector.name
        and all(matches(m, s.labels.get(m.name, "")) for m in selector.matchers.matchers)
    ]


def complete(url: str, prompt: str, **body: Any) -> None:
    r = httpx.post(
        url + "/v1/completions",
        json={"model": "Test-Model", "prompt": prompt, "max_tokens": 4, **body},
        timeout=30,
    )
    assert r.status_code == 200, r.text


def put_settings(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.put(url + "/admin/scheduler_config", json=body, headers=ADMIN, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    """A simulated replica (tiers with and without a queue-wait limit) and a router in front
    of it and of a dead replica (so a replica gets ejected), after a few requests per tier."""
    tmp = tmp_path_factory.mktemp("obs")
    profile = write_profile(tmp / "profile.json", make_profile(fixed_s=0.002))
    tiers = tmp / "tiers.yaml"
    tiers.write_text(yaml.safe_dump(TIERS))
    replica_flags = [
        "--simulate",
        str(profile),
        "--tiers",
        str(tiers),
        "--admin-token",
        "obs-admin",
    ]
    with run_server(*replica_flags, port=REPLICA_PORT, startup_timeout_s=30) as replica:
        backends = ["--backend", replica.url, "--backend", f"http://127.0.0.1:{DEAD_PORT}"]
        with run_server(
            *backends, "--poll-interval-ms", "20", command="router", port=ROUTER_PORT,
            startup_timeout_s=30,
        ) as router:  # fmt: skip
            for i, tier in enumerate(["premium", "standard", "best-effort"]):
                complete(router.url, f"request {i} of tier {tier}, a few words long", priority=tier)
            complete(router.url, "a streamed one", stream=True)
            yield replica, router


@pytest.fixture(scope="module")
def exported(fleet: tuple[Server, Server]) -> Series:
    """The series of the replica and of the router (once the dead replica is ejected)."""
    replica, router = fleet
    deadline = time.monotonic() + 10
    while True:  # the router polls every 20 ms: three failed polls eject the dead replica
        router_samples = scrape(router.url)
        if any(s.name == "iterserve_router_ejections_total" for s in router_samples):
            break
        assert time.monotonic() < deadline, "the dead replica was never ejected"
    return {**series_of(scrape(replica.url)), **series_of(router_samples), **operator_series()}


def operator_series() -> Series:
    """The operator's series (iterserve operator run --metrics-port) once it reconciled one
    LLMDeployment."""
    metrics = OperatorMetrics()
    metrics.record({"metadata": {"namespace": "serving", "name": LLMD}}, 0.01, 1, "promoted")
    text = generate_latest(metrics.registry).decode()
    return series_of([s for f in text_string_to_metric_families(text) for s in f.samples])


# ----------------------------------------------------------------- tests


def test_the_objects_are_off_by_default_and_carry_the_values_labels(
    helm: Path, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    default = render(helm)
    assert "PrometheusRule" not in default
    assert not [c for c in default.get("ConfigMap", []) if "iterserve.json" in c["data"]]

    (rule,) = rendered["PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    (cm,) = [c for c in rendered["ConfigMap"] if "iterserve.json" in c["data"]]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # the sidecar's default label
    # The file's dashboard, with the release's uid and title.
    shipped = json.loads((CHART / "dashboards" / "iterserve.json").read_text())
    board = json.loads(cm["data"]["iterserve.json"])
    assert {k: v for k, v in board.items() if k not in ("uid", "title")} == {
        k: v for k, v in shipped.items() if k not in ("uid", "title")
    }

    custom = render(
        helm,
        "dashboard.enabled=true",
        "alerts.enabled=true",
        "dashboard.annotations.grafana_folder=iterserve",
        "alerts.labels.release=kube-prometheus-stack",
    )
    (cm,) = [c for c in custom["ConfigMap"] if "iterserve.json" in c["data"]]
    assert cm["metadata"]["annotations"] == {"grafana_folder": "iterserve"}
    assert custom["PrometheusRule"][0]["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_each_release_renders_its_own_dashboard_uid_and_title(helm: Path) -> None:
    """The Grafana sidecar loads every release's ConfigMap into one Grafana: the uid (40
    characters at most) and the title must differ between releases, and stay the same across
    upgrades of one release (bookmarks, links)."""

    def board(name: str, namespace: str) -> dict[str, Any]:
        objects = render(helm, "dashboard.enabled=true", release=(name, namespace))
        (cm,) = [c for c in objects["ConfigMap"] if "iterserve.json" in c["data"]]
        return json.loads(cm["data"]["iterserve.json"])  # type: ignore[no-any-return]

    releases = [("iterserve", "team-a"), ("iterserve", "team-b"), ("other", "team-a"),
                ("a" * 53, "n" * 63)]  # fmt: skip
    boards = [board(*r) for r in releases]
    uids = [b["uid"] for b in boards]
    assert len(set(uids)) == len(uids), uids
    assert all(re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", u) for u in uids), uids
    assert len({b["title"] for b in boards}) == len(boards)
    assert boards[0]["title"] == "iterserve (team-a/iterserve)"
    assert board("iterserve", "team-a")["uid"] == uids[0]  # stable


def test_the_dashboard_is_a_current_grafana_dashboard_with_the_issues_panels(
    dashboard: dict[str, Any],
) -> None:
    assert dashboard["schemaVersion"] >= 39
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "llmdeployment"} <= set(variables)
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    metrics = set()
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel
        assert panel["targets"] and panel["description"], panel["title"]
        for target in panel["targets"]:
            assert '$namespace"' in target["expr"] and "$llmdeployment" in target["expr"], target
            metrics |= {s.name for s in selectors(grafana_to_promql(target["expr"]))}
    # The panels docs/observability.md lists: throughput, TTFT/TPOT/ITL, queues and queue
    # time, KV, preemptions, rejections, iterations, config version, router picks, retries,
    # codes, ready replicas; per-tenant queue time and rejections.
    assert {
        "iterserve_request_success_total", "iterserve_generation_tokens_total",
        "iterserve_time_to_first_token_seconds_bucket",
        "iterserve_request_time_per_output_token_seconds_bucket",
        "iterserve_inter_token_latency_seconds_bucket", "iterserve_num_requests_running",
        "iterserve_num_requests_waiting", "iterserve_num_requests_swapped",
        "iterserve_request_queue_time_seconds_bucket", "iterserve_tier_max_queue_wait_seconds",
        "iterserve_kv_cache_usage_ratio", "iterserve_num_preemptions_total",
        "iterserve_requests_rejected_total", "iterserve_iteration_latency_seconds_bucket",
        "iterserve_iteration_tokens_bucket", "iterserve_scheduler_config_version",
        "iterserve_router_picks_total", "iterserve_router_retries_total",
        "iterserve_router_requests_total", "iterserve_router_ready_replicas",
        "iterserve_tenant_request_queue_time_seconds_bucket",
        "iterserve_tenant_requests_rejected_total", "iterserve_operator_reconciles_total",
        "iterserve_operator_push_duration_seconds_bucket",
        "iterserve_operator_pods_not_at_desired_settings", "iterserve_operator_rollouts_total",
    } <= metrics  # fmt: skip


def test_every_query_reads_series_the_replica_or_the_router_exports(
    dashboard: dict[str, Any], rendered: dict[str, list[dict[str, Any]]], exported: Series
) -> None:
    queries = dashboard_queries(dashboard)
    queries |= {f"alert {name}": r["expr"] for name, r in alert_rules(rendered).items()}
    errors: list[str] = []
    for where, expr in queries.items():
        found: list[str] = []
        result_labels(pp.parse(expr), exported, found)
        errors += [f"{where}: {e}" for e in found]
    assert not errors, "\n".join(errors)
    # The check itself finds what is missing: a label nobody exports, a renamed metric.
    for bad in ("sum by (tenant) (iterserve_request_success_total)", "iterserve_request_success"):
        found = []
        result_labels(pp.parse(bad), exported, found)
        assert found, bad


def test_the_pod_selectors_follow_the_operators_pod_names(
    dashboard: dict[str, Any], rendered: dict[str, list[dict[str, Any]]]
) -> None:
    pods: dict[str, set[str]] = {"server": set(), "router": set()}
    for expr in dashboard_queries(dashboard).values():
        for s in selectors(expr):
            kind = "router" if s.name.startswith("iterserve_router_") else "server"
            pods[kind] |= {m.value for m in s.matchers.matchers if m.name == "pod"}
    # The same regexes as the autoscaler's queries: pods of Deployment N, not N-router's.
    assert pods == {"server": {pod_regex(LLMD)}, "router": {pod_regex(router_name(LLMD))}}
    server, router = pod_regex(LLMD), pod_regex(router_name(LLMD))
    server_pod, router_pod = f"{LLMD}-7d9f8b6c4-x2x9q", f"{LLMD}-router-5c8d7f9b6-k4m2p"
    assert re.fullmatch(server, server_pod) and not re.fullmatch(server, router_pod)
    assert re.fullmatch(router, router_pod) and not re.fullmatch(router, server_pod)
    # The LLMDeployment variable takes the names from the server pods and from the router
    # pods (a model scaled to zero keeps its routers), the alerts' label_replace from a pod's.
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    union = pp.parse(grafana_to_promql(variable_expr(variables["llmdeployment"]))).expr
    assert str(union.op) == "or"
    sides = [(union.lhs, server_pod, "iterserve_scheduler_config_version"),
             (union.rhs, router_pod, "iterserve_router_ready_replicas")]  # fmt: skip
    for side, pod, metric in sides:
        assert side.func.name == "label_replace" and side.args[1].val == "llmdeployment"
        assert side.args[0].name == metric
        assert (m := re.fullmatch(side.args[4].val, pod)) and m[1] == LLMD
    for name, label, value in (("llmdeployment", "llmdeployment", LLMD),
                               ("namespace", "namespace", "serving")):  # fmt: skip
        line = query_result_line({label: value})
        assert (m := re.search(variables[name]["regex"].strip("/"), line)) and m[1] == value
    namespaces = {s.name for s in selectors(variable_expr(variables["namespace"]))}
    assert namespaces == {"iterserve_scheduler_config_version", "iterserve_router_ready_replicas"}
    skew = pp.parse(alert_rules(rendered)["IterserveSchedulerConfigSkew"]["expr"])
    replace = skew.lhs.expr  # max by (namespace, llmdeployment) (label_replace(...))
    assert replace.func.name == "label_replace"
    assert (m := re.fullmatch(replace.args[4].val, server_pod)) and m[1] == LLMD


def test_alerts_carry_severity_runbook_and_the_values_thresholds(helm: Path) -> None:
    rules = alert_rules(
        render(
            helm,
            "alerts.enabled=true",
            "alerts.kvLeakFor=20m",
            "alerts.configSkewFor=11m",
            "alerts.queueWaitFor=7m",
            "alerts.prefillTokenCeiling=1024",
            set_json="alerts.kvUsageRatio=0.9",  # --set makes 0.9 a string
        )
    )
    assert set(rules) == {
        "IterserveKVCacheNearFull", "IterserveTierQueueWaitOverLimit", "IterservePrefillStall",
        "IterserveKVBlocksNotReturned", "IterserveSchedulerConfigSkew",
    }  # fmt: skip
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and "Runbook:" in rule["annotations"]["description"]
        assert "{{ $labels." in rule["annotations"]["summary"], name  # Prometheus' templating
    assert rules["IterserveKVBlocksNotReturned"]["for"] == "20m"
    assert rules["IterserveSchedulerConfigSkew"]["for"] == "11m"
    assert rules["IterserveTierQueueWaitOverLimit"]["for"] == "7m"
    assert rules["IterservePrefillStall"]["for"] == "5m"  # one busy window does not page
    near_full = pp.parse(rules["IterserveKVCacheNearFull"]["expr"])
    assert near_full.lhs.rhs.val == 0.9  # (max(usage) > 0.9) and on(...) (preemptions > 0)
    _, bucket = selectors(rules["IterservePrefillStall"]["expr"])  # count - bucket{le=~...}
    (le,) = [m.value for m in bucket.matchers.matchers if m.name == "le"]
    assert re.fullmatch(le, "1024.0") and re.fullmatch(le, "1024") and not re.fullmatch(le, "10240")

    bad = subprocess.run(
        [str(helm), "template", str(CHART), "--set", "alerts.enabled=true",
         "--set", "alerts.prefillTokenCeiling=3000"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert bad.returncode != 0 and "power of two" in bad.stderr


def test_the_prefill_ceiling_is_a_bucket_bound_of_the_histogram(
    fleet: tuple[Server, Server], rendered: dict[str, list[dict[str, Any]]]
) -> None:
    replica, _ = fleet
    bounds = {
        s.labels["le"] for s in scrape(replica.url) if s.name == "iterserve_iteration_tokens_bucket"
    }
    _, bucket = selectors(alert_rules(rendered)["IterservePrefillStall"]["expr"])
    (le,) = [m.value for m in bucket.matchers.matchers if m.name == "le"]
    assert [b for b in bounds if re.fullmatch(le, b)] == ["4096.0"]  # the default ceiling
    # The template's list of allowed ceilings is the histogram's finite bounds.
    template = (CHART / "templates" / "prometheusrule.yaml").read_text()
    m = re.search(r"\$buckets := list ([\d ]+)", template)
    assert m and {float(b) for b in m[1].split()} == {float(b) for b in bounds} - {float("inf")}


def test_the_prefill_stall_selectors_count_iterations_over_the_ceiling(
    helm: Path, fleet: tuple[Server, Server]
) -> None:
    replica, _ = fleet
    expr = alert_rules(render(helm, "alerts.enabled=true", "alerts.prefillTokenCeiling=64"))[
        "IterservePrefillStall"
    ]["expr"]
    count, bucket = selectors(expr)  # count{phase=prefill} - bucket{phase=prefill, le=64}

    def over_ceiling() -> float:
        samples = scrape(replica.url)
        ((c,), (b,)) = selected(count, samples), selected(bucket, samples)
        return float(c.value - b.value)

    before = over_ceiling()
    complete(replica.url, "short prompt, about ten tokens long...")  # 10 prefill tokens
    assert over_ceiling() == before
    complete(replica.url, "long " * 160)  # 200 tokens in one iteration (budget 256)
    assert over_ceiling() == before + 1
    # The runbook's fix: chunk prefills at or below the ceiling; the next long prompt is split.
    put_settings(replica.url, {"long_prefill_token_threshold": 64})
    try:
        complete(replica.url, "other " * 140)
        assert over_ceiling() == before + 1
    finally:
        put_settings(replica.url, {"long_prefill_token_threshold": 0})


def test_the_tier_limit_gauge_follows_the_live_settings(fleet: tuple[Server, Server]) -> None:
    replica, _ = fleet

    def limits() -> dict[str, float]:
        samples = scrape(replica.url)
        return {
            s.labels["tier"]: s.value
            for s in samples
            if s.name == "iterserve_tier_max_queue_wait_seconds"
        }

    def version() -> float:
        (v,) = [
            s.value for s in scrape(replica.url) if s.name == "iterserve_scheduler_config_version"
        ]
        return float(v)

    assert limits() == {"premium": 0.5, "standard": 2.0}  # best-effort has no limit: no series
    new = [
        {"name": "premium", "priority": 0, "max_queue_wait_ms": 250},
        {"name": "standard", "priority": 1},
        {"name": "best-effort", "priority": 2, "max_queue_wait_ms": 4000},
    ]
    applied = put_settings(replica.url, {"tiers": new})
    try:
        assert limits() == {"premium": 0.25, "best-effort": 4.0}
        assert version() == applied["config_version"]
    finally:
        restored = put_settings(replica.url, {"tiers": TIERS})
    assert limits() == {"premium": 0.5, "standard": 2.0}
    assert version() == restored["config_version"] == applied["config_version"] + 1


def test_the_kv_leak_alert_reads_blocks_held_by_requests_not_cached_ones(
    fleet: tuple[Server, Server], rendered: dict[str, list[dict[str, Any]]]
) -> None:
    replica, _ = fleet
    rule = alert_rules(rendered)["IterserveKVBlocksNotReturned"]["expr"]
    names = {s.name for s in selectors(rule)}
    assert names == {
        "iterserve_kv_cache_usage_ratio", "iterserve_num_requests_running",
        "iterserve_num_requests_waiting", "iterserve_num_requests_swapped",
    }  # fmt: skip

    def values() -> dict[str, float]:
        return {s.name: s.value for s in scrape(replica.url) if s.name in names}

    # Mid-request: blocks held, a request running (the condition's second half is false).
    body = {"model": "Test-Model", "prompt": "held " * 40, "max_tokens": 200, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", replica.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()  # kept: a dropped generator closes the stream (an abort)
        assert next(lines).startswith("data: {")
        during = values()
    assert during["iterserve_kv_cache_usage_ratio"] > 0, during
    assert during["iterserve_num_requests_running"] >= 1
    # Every request over (the stream was closed: aborted): no block held, though the prefix
    # cache keeps the prompts' full blocks; usage 0 and so the alert stays silent.
    deadline = time.monotonic() + 10
    while True:
        idle = values()
        if sum(v for k, v in idle.items() if k != "iterserve_kv_cache_usage_ratio") == 0:
            break
        assert time.monotonic() < deadline, f"the aborted request is still there: {idle}"
    load = httpx.get(replica.url + "/load", timeout=5).json()
    assert load["num_cached_blocks"] > 0
    assert idle["iterserve_kv_cache_usage_ratio"] == 0 == load["kv_cache_usage"]
    assert idle["iterserve_num_requests_running"] == idle["iterserve_num_requests_waiting"] == 0


def queue_wait_bound(rules: dict[str, dict[str, Any]]) -> list[tuple[float, float]]:
    """The queue-wait alert's right-hand side, ``max by (...) (label_replace(A or B or ...))``
    with each branch ``(limit <= BOUND) * 0 + VALUE``: the (BOUND, VALUE) of each, in order."""
    expr = pp.parse(rules["IterserveTierQueueWaitOverLimit"]["expr"])
    assert str(expr.op) == ">" and expr.lhs.func.name == "histogram_quantile"
    assert expr.lhs.args[0].val == 0.99
    replace = expr.rhs.expr
    assert replace.func.name == "label_replace"
    branches, node = [], replace.args[0]
    while str(node.op) == "or":  # or is left-associative: ((b1 or b2) or b3)
        branches.append(node.rhs)
        node = node.lhs
    branches.append(node)
    pairs = []
    for branch in reversed(branches):
        assert str(branch.op) == "+" and str(branch.lhs.op) == "*" and branch.lhs.rhs.val == 0
        compare = branch.lhs.lhs.expr  # (limit <= BOUND)
        assert str(compare.op) == "<=" and compare.modifier is None  # a filter, not bool
        assert compare.lhs.name == "iterserve_tier_max_queue_wait_seconds"
        pairs.append((compare.rhs.val, branch.rhs.val))
    return pairs


def histogram_quantile(q: float, bounds: list[float], waits: list[float]) -> float:
    """Prometheus' histogram_quantile over the buckets ``waits`` fall in (linear inside the
    bucket the rank lands in; the highest finite bound when it lands in +Inf)."""
    counts = [sum(w <= b for w in waits) for b in bounds]
    rank = q * len(waits)
    for i, (bound, count) in enumerate(zip(bounds, counts, strict=True)):
        if count >= rank:
            lower, below = (bounds[i - 1], counts[i - 1]) if i else (0.0, 0)
            return lower + (bound - lower) * (rank - below) / (count - below)
    return bounds[-1]


def test_the_queue_wait_alert_compares_with_the_bucket_bound_at_or_above_the_limit(
    fleet: tuple[Server, Server], rendered: dict[str, list[dict[str, Any]]]
) -> None:
    """histogram_quantile interpolates inside a bucket: with a limit between two bounds, p99
    can read above the limit while every request waited less. The alert compares p99 with the
    first bound >= the limit instead (p99 > a bound holds exactly when more than 1% of the
    requests waited longer than it), so it never fires while every wait is within the limit."""
    replica, _ = fleet
    exposed = sorted(
        float(s.labels["le"])
        for s in scrape(replica.url)
        if s.name == "iterserve_request_queue_time_seconds_bucket" and s.labels["tier"] == "premium"
    )
    finite = exposed[:-1]
    assert exposed[-1] == float("inf")
    pairs = queue_wait_bound(alert_rules(rendered))
    # Each branch maps the limits up to a bound onto that bound; the bounds in order are the
    # histogram's, the last one (whose bucket reaches to +Inf) left out.
    assert all(bound == value for bound, value in pairs)
    assert [b for b, _ in pairs] == finite[:-1]

    def bound_of(limit: float) -> float | None:  # the `or` chain: the first branch that holds
        return next((value for bound, value in pairs if limit <= bound), None)

    assert bound_of(0.25) == 0.3 and bound_of(0.3) == 0.3 and bound_of(0.001) == finite[0]
    assert bound_of(finite[-2]) == finite[-2] and bound_of(finite[-2] + 1) is None

    def fires(limit: float, waits: list[float]) -> bool:
        bound = bound_of(limit)
        return bound is not None and histogram_quantile(0.99, finite, waits) > bound

    # A 250 ms limit, every wait 0.21-0.25 s: p99 interpolates to 0.299 s, yet none is late.
    within = [0.21 + 0.04 * i / 99 for i in range(100)]
    assert histogram_quantile(0.99, finite, within) > 0.25
    assert not fires(0.25, within)
    # 2% of the requests past the bound: fires; with a limit on a bound it is exact.
    late = [*within[2:], 0.35, 0.35]
    assert fires(0.25, late) and fires(0.3, late) and not fires(0.4, late)


def test_the_alerts_keep_to_the_watched_namespaces(helm: Path) -> None:
    """With watchNamespaces, every selector of every alert matches only those namespaces (one
    release per team alerts on its own LLMDeployments, never twice on one); cluster-wide, no
    selector filters on the namespace."""
    scoped = alert_rules(render(helm, "alerts.enabled=true", "watchNamespaces={team-a,team-b}"))
    everywhere = alert_rules(render(helm, "alerts.enabled=true"))
    assert set(scoped) == set(everywhere)
    for name in scoped:
        for s in selectors(scoped[name]["expr"]):
            matchers = [(m.name, m.op, m.value) for m in s.matchers.matchers]
            assert ("namespace", pp.MatchOp.Re, "team-a|team-b") in matchers, (name, s)
        for s in selectors(everywhere[name]["expr"]):
            assert "namespace" not in {m.name for m in s.matchers.matchers}, (name, s)
