"""Tenants at the server: the per-tenant queue cap (``max_waiting_per_tenant``, a live setting)
and the per-tenant metrics with their bounded ``tenant`` label, over a fake engine client."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import FakeClock, FakeEngineClient, run_with_server, until
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from iterserve.cli import _pop_fields, build_parser, engine_kwargs
from iterserve.config import ConfigError, SchedulerConfig, ServerConfig
from iterserve.server.admission import Admission, Rejected
from iterserve.server.metrics import ServerMetrics
from iterserve.server.protocol import APIError
from iterserve.server.tenants import TenantLabels, resolve_tenant

ADMIN = {"Authorization": "Bearer admin-fake"}
URL = "/admin/scheduler_config"
BODY = {"prompt": "Hi", "max_tokens": 1}


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """{(sample name, its labels): value} of an exposition (parsed as Prometheus would)."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(metrics: dict[Any, float], name: str, **labels: str) -> float | None:
    return metrics.get((name, frozenset(labels.items())))


# ----------------------------------------------------------------- units


def test_the_cap_counts_a_tenants_queued_requests_but_not_defaults() -> None:
    clock = FakeClock(100.0)
    admission = Admission(clock)
    config = SchedulerConfig(max_waiting=10, max_waiting_per_tenant=2)
    for i in range(2):
        admission.check(config, 1, tenant="a")
        admission.enqueue(f"a{i}", 1, "a")
    with pytest.raises(Rejected) as e:
        admission.check(config, 1, tenant="a")
    assert (e.value.status, e.value.reason) == (429, "tenant_queue_full")
    assert e.value.headers["Retry-After"] == "1"  # no drain measured yet
    admission.check(config, 1, tenant="b")  # another tenant is admitted
    for i in range(3):  # the default tenant is not capped
        admission.check(config, 1)
        admission.enqueue(f"d{i}", 1)
    # Drain 0.5 requests/s; two tenants queued share it: one more slot of a's takes 4 s.
    for i in range(4):
        admission.enqueue(f"x{i}", 1)
        admission.left_queue(f"x{i}")
        clock.advance(2.0)
    with pytest.raises(Rejected) as e:
        admission.check(config, 1, tenant="a")
    assert e.value.headers["Retry-After"] == "4"
    with pytest.raises(APIError) as bad:  # a batch the cap can never hold: 400, not 429
        admission.check(config, 1, num_requests=3, tenant="b")
    assert bad.value.status == 400 and "max_waiting_per_tenant=2" in bad.value.message
    admission.left_queue("a0", started=False)
    admission.left_queue("a0")  # idempotent
    admission.check(config, 1, tenant="a")
    admission.left_queue("a1")
    assert "a" not in admission.num_queued_by_tenant  # no entry kept per tenant ever seen
    admission.check(SchedulerConfig(max_waiting=10), 1, 7, tenant="a")  # the cap off: admitted


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_waiting_per_tenant": 0}, "max_waiting_per_tenant must be in"),
        (
            {"max_waiting": 8, "max_waiting_per_tenant": 9},
            r"<= max_waiting \(got .*max_waiting=8\)",
        ),
        ({"max_waiting_per_tenant": 1.5}, "integer"),
    ],
)
def test_the_cap_is_validated(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SchedulerConfig(**kwargs)


def test_the_flags_and_the_config_file(tmp_path: Path) -> None:
    config_file = tmp_path / "serve.yaml"
    config_file.write_text("max-waiting-per-tenant: 3\ntenant_label_limit: 5\n")
    parser = build_parser()
    args = parser.parse_args(["serve", "--config", str(config_file)])
    kwargs = engine_kwargs(args, parser, (SchedulerConfig, ServerConfig))
    assert ServerConfig(**_pop_fields(kwargs, ServerConfig)).tenant_label_limit == 5
    assert SchedulerConfig(**kwargs).max_waiting_per_tenant == 3
    args = parser.parse_args(
        ["serve", "--max-waiting-per-tenant", "4", "--tenant-label-limit", "0"]
    )
    assert (args.max_waiting_per_tenant, args.tenant_label_limit) == (4, 0)
    assert (
        SchedulerConfig().max_waiting_per_tenant is None and ServerConfig().tenant_label_limit == 20
    )
    with pytest.raises(ConfigError, match="tenant_label_limit"):
        ServerConfig(tenant_label_limit=-1)


def test_the_first_tenants_keep_their_label_and_later_ones_are_other() -> None:
    labels = TenantLabels(20)
    assert [labels(f"t{i}") for i in range(20)] == [f"t{i}" for i in range(20)]
    assert labels("t20") == labels("t21") == "other"
    assert labels("t0") == "t0" and labels("default") == "default"  # no churn; default is free
    none = TenantLabels(0)
    assert (none("a"), none("default")) == ("other", "default")


def test_an_untrusted_tenant_name_cannot_break_the_exposition() -> None:
    tenant = resolve_tenant(None, 'a"b\\c}{d,e="f"\n# HELP x\r\x00 日本\u2028z')
    metrics = ServerMetrics()
    metrics.count_rejection("queue_full", tenant)
    metrics.observe_tenant_queue_time(tenant, 0.25)
    parsed = samples(generate_latest(metrics.registry).decode())
    rejected = "iterserve_tenant_requests_rejected_total"
    assert value(parsed, rejected, tenant=tenant, reason="queue_full") == 1.0
    count = "iterserve_tenant_request_queue_time_seconds_count"
    assert value(parsed, count, tenant=tenant) == 1.0
    assert not [k for k in parsed if k[0].startswith("x")]  # no injected family


# ----------------------------------------------------------------- HTTP


def test_a_tenant_over_its_cap_gets_429_while_other_tenants_are_admitted(tokenizer: Any) -> None:
    clock = FakeClock(1000.0)

    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        def post(tenant: str | None = None, **extra: Any) -> asyncio.Task[httpx.Response]:
            headers = {"X-Tenant-Id": tenant} if tenant else {}
            request = http.post("/v1/completions", json={**BODY, **extra}, headers=headers)
            return asyncio.create_task(request)

        noisy = [post("noisy"), post(user="noisy")]  # the header or the user field: one tenant
        await until(lambda: fake.num_live == 2, "2 queued")
        r = await http.post("/v1/completions", json=BODY, headers={"X-Tenant-Id": "noisy"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"] == {
            "message": "tenant 'noisy' has 2 requests queued (max_waiting_per_tenant=2); "
            "retry later",
            "type": "rate_limit_error",
            "param": None,
            "code": "tenant_queue_full",
        }
        others = [post("quiet"), post(), post(), post()]  # default: 3 queued, not capped
        await until(lambda: fake.num_live == 6, "the others queued")
        clock.advance(2.0)
        fake.max_running = 32
        fake.step()
        responses = [await t for t in noisy + others]
        assert [r.status_code for r in responses] == [200] * 6
        metrics = samples((await http.get("/metrics")).text)
        assert value(metrics, "iterserve_requests_rejected_total", reason="tenant_queue_full") == 1
        rejected = "iterserve_tenant_requests_rejected_total"
        assert value(metrics, rejected, tenant="noisy", reason="tenant_queue_full") == 1
        assert value(metrics, rejected, tenant="quiet", reason="tenant_queue_full") == 0
        assert value(metrics, rejected, tenant="default", reason="queue_full") == 0
        queue_time = "iterserve_tenant_request_queue_time_seconds"
        for tenant, num in (("noisy", 2), ("quiet", 1), ("default", 3)):
            assert value(metrics, queue_time + "_count", tenant=tenant) == num
            assert value(metrics, queue_time + "_sum", tenant=tenant) == 2.0 * num
            assert value(metrics, queue_time + "_bucket", tenant=tenant, le="1.5") == 0
            assert value(metrics, queue_time + "_bucket", tenant=tenant, le="2.0") == num
        # The series without a tenant label are unchanged.
        assert value(metrics, "iterserve_request_queue_time_seconds_count", tier="standard") == 6

    scheduler = SchedulerConfig(
        max_num_seqs=32, max_num_batched_tokens=512, max_waiting=8, max_waiting_per_tenant=2
    )
    run_with_server(
        tokenizer, check, clock=clock, auto_step=False, max_running=0, scheduler=scheduler
    )


def test_a_live_put_changes_the_cap(tokenizer: Any) -> None:
    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        async def put(body: dict[str, Any], status: int = 200) -> dict[str, Any]:
            r = await http.put(URL, json=body, headers=ADMIN)
            assert r.status_code == status, r.text
            return r.json()  # type: ignore[no-any-return]

        def post() -> asyncio.Task[httpx.Response]:
            headers = {"X-Tenant-Id": "t"}
            return asyncio.create_task(http.post("/v1/completions", json=BODY, headers=headers))

        assert (await http.get(URL, headers=ADMIN)).json()["max_waiting_per_tenant"] is None
        queued = [post() for _ in range(3)]  # no cap by default
        await until(lambda: fake.num_live == 3, "3 queued")
        before = (await http.get(URL, headers=ADMIN)).json()["config_hash"]
        after = await put({"max_waiting_per_tenant": 3})
        assert after["max_waiting_per_tenant"] == 3 and after["config_hash"] != before
        assert fake.config_updates[-1].max_waiting_per_tenant == 3
        r = await http.post("/v1/completions", json=BODY, headers={"X-Tenant-Id": "t"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_queue_full"
        await put({"max_waiting_per_tenant": 4})
        queued.append(post())
        await until(lambda: fake.num_live == 4, "the 4th queued under the raised cap")
        error = await put({"max_waiting_per_tenant": 0}, 422)
        assert "max_waiting_per_tenant must be in [1, max_waiting=8]" in error["error"]["message"]
        await put({"max_waiting_per_tenant": 9}, 422)
        assert (await put({"max_waiting_per_tenant": None}))["max_waiting_per_tenant"] is None
        queued.append(post())
        await until(lambda: fake.num_live == 5, "off again")
        fake.max_running = 32
        fake.step()
        assert [(await t).status_code for t in queued] == [200] * 5

    scheduler = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512, max_waiting=8)
    run_with_server(
        tokenizer,
        check,
        ServerConfig(admin_token="admin-fake"),
        auto_step=False,
        max_running=0,
        scheduler=scheduler,
    )


def test_the_21st_tenant_is_labelled_other(tokenizer: Any) -> None:
    weird = 'x"y\\z}\n日本'

    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        tenants = [weird] + [f"tenant-{i}" for i in range(1, 22)]  # 22 named tenants
        for tenant in [*tenants, "tenant-1"]:
            r = await http.post("/v1/completions", json={**BODY, "user": tenant})
            assert r.status_code == 200, r.text
        assert (await http.post("/v1/completions", json=BODY)).status_code == 200
        metrics = samples((await http.get("/metrics")).text)
        count = "iterserve_tenant_request_queue_time_seconds_count"
        labelled = {dict(k[1])["tenant"]: v for k, v in metrics.items() if k[0] == count}
        expected = {resolve_tenant(None, weird): 1.0}
        expected |= {f"tenant-{i}": 1.0 for i in range(2, 20)}
        expected |= {"tenant-1": 2.0, "other": 2.0, "default": 1.0}
        assert labelled == expected

    run_with_server(tokenizer, check)
