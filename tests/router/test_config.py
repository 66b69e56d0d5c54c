"""``iterserve router``'s flags are RouterConfig's fields: one default, checked once."""

from __future__ import annotations

import dataclasses

import pytest

from iterserve import envs
from iterserve.cli import build_parser
from iterserve.router.config import RouterConfig


def _parse(*argv: str) -> RouterConfig:
    return RouterConfig.from_args(build_parser().parse_args(["router", *argv]))


def test_every_field_is_a_flag_with_the_fields_default() -> None:
    config = _parse("--backend", "http://a:1")
    defaults = RouterConfig(backend=("http://a:1",))
    assert config == defaults
    for f in dataclasses.fields(RouterConfig):
        if f.name != "backend":
            assert getattr(config, f.name) == f.default, f.name


def test_the_flags_the_chart_and_the_operator_pass_keep_their_names_and_defaults() -> None:
    config = _parse("--k8s-service", "llm-server")
    assert (config.namespace, config.k8s_port_name, config.policy, config.port) == (
        "default",
        "http",
        "least_kv",
        8080,
    )
    assert (config.poll_interval_ms, config.stale_after_ms, config.eject_after) == (50.0, 500.0, 3)
    assert (config.shutdown_grace_period_s, config.max_request_body_bytes) == (30.0, 4 << 20)
    config = _parse(
        "--backend", "http://a:1", "--backend", "https://b:2", "--no-prefix-affinity",
        "--policy", "session", "--backend-type", "vllm", "--read-timeout-s", "5",
    )  # fmt: skip
    assert config.backend == ("http://a:1", "https://b:2")
    assert (config.prefix_affinity, config.policy, config.backend_type) == (
        False,
        "session",
        "vllm",
    )
    assert config.read_timeout_s == 5.0


def test_the_mode_and_hold_flags_of_the_contract() -> None:
    config = _parse("--k8s-service", "llm-server")
    assert (config.mode, config.grpc_port) == ("proxy", 9002)
    assert (config.hold_timeout_s, config.max_held_requests) == (60.0, 256)
    assert config.sheddable == frozenset({"best-effort"})
    config = _parse(
        "--k8s-service", "s", "--mode", "endpoint-picker", "--grpc-port", "9100",
        "--hold-timeout-s", "0", "--max-held-requests", "8", "--sheddable-tiers", "batch, bulk",
    )  # fmt: skip
    assert (config.mode, config.grpc_port, config.hold_timeout_s) == ("endpoint-picker", 9100, 0)
    assert config.max_held_requests == 8 and config.sheddable == frozenset({"batch", "bulk"})
    with pytest.raises(SystemExit):
        _parse("--k8s-service", "s", "--mode", "gateway")


def test_keys_fall_back_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(envs, "ITERSERVE_API_KEY", "from-env")
    monkeypatch.setattr(envs, "ITERSERVE_BACKEND_API_KEY", "inner-env")
    config = _parse("--backend", "http://a:1")
    assert (config.api_key, config.backend_api_key) == ("from-env", "inner-env")
    config = _parse("--backend", "http://a:1", "--api-key", "flag", "--backend-api-key", "f2")
    assert (config.api_key, config.backend_api_key) == ("flag", "f2")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({}, "give --backend URL"),
        ({"backend": ("http://a:1",), "k8s_service": "s"}, "either --backend or --k8s-service"),
        (
            {"backend": ("http://a:1",), "read_timeout_s": 0},
            "--read-timeout-s must be a positive number",
        ),
        ({"backend": ("http://a:1",), "poll_interval_ms": float("inf")}, "--poll-interval-ms"),
        ({"k8s_service": "s", "poll_timeout_ms": 500.0}, "below --stale-after-ms"),
        ({"backend": ("a:1",)}, "http://host:port"),
        ({"backend": ("http://a:0",)}, "http://host:port"),
        ({"backend": ("http://a:99999",)}, "--backend 'http://a:99999'"),
        ({"k8s_service": "s", "eject_after": 0}, "--eject-after must be >= 1"),
        ({"k8s_service": "s", "grpc_port": 70000}, "--grpc-port must be a TCP port"),
        ({"k8s_service": "s", "destination_endpoints": 0}, "--destination-endpoints"),
        ({"k8s_service": "s", "shed_queue_depth": 0}, "--shed-queue-depth"),
        ({"k8s_service": "s", "shed_kv_usage": 1.5}, "--shed-kv-usage must be in"),
        ({"k8s_service": "s", "hold_timeout_s": -1}, "--hold-timeout-s must be >= 0"),
        ({"k8s_service": "s", "hold_timeout_s": float("inf")}, "--hold-timeout-s"),
        ({"k8s_service": "s", "max_held_requests": -1}, "--max-held-requests"),
    ],
)
def test_inconsistent_settings_name_the_flag(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RouterConfig(**settings)
