"""The server under schemathesis, against its own OpenAPI schema (``/openapi.json``).

Every operation gets positive and negative cases generated from the schema; a response must
not be a 5xx, its status must be documented, and its body and content type must match what
the schema documents for that status (SSE events of ``stream: true`` included). Cases are also
sent without credentials where the schema declares a bearer scheme: 401, documented.

Two runs: (a) over the fake engine, in-process (every operation, many cases, seconds);
(b) over the real default model (the session server: few cases, small ``max_tokens``), then
``/health`` and a normal completion. Seeded and derandomized: CI sees the same cases.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from fake_engine import FakeEngineClient, run_with_server
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import CheckFunction, not_a_server_error
from schemathesis.specs.openapi import checks
from server_utils import ADMIN_TOKEN, API_KEY, Server

from iterserve.config import ServerConfig
from iterserve.server.app import build_app

# What any response must satisfy, then what the case must (invalid input refused, auth
# enforced). Not positive_data_acceptance: the schema gives types, and the value ranges
# SamplingParams checks (temperature, penalties, lengths) make many schema-valid bodies a 400.
RESPONSE_CHECKS: list[CheckFunction] = [
    not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
    checks.response_headers_conformance,
]
CHECKS = [*RESPONSE_CHECKS, checks.negative_data_rejection, checks.ignored_auth]
# Credentials are the test's (credentials()), not generated ones; cases are reproducible
# through hypothesis' derandomize (fuzz()).
CONFIG = schemathesis.Config.from_dict({"generation": {"with-security-parameters": False}})
ADMIN_PATH = "/admin/scheduler_config"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def credentials(case: schemathesis.Case) -> dict[str, str]:
    token = ADMIN_TOKEN if case.path.startswith("/admin/") else API_KEY
    return {"Authorization": f"Bearer {token}"}


def bound(case: schemathesis.Case, max_tokens: int, max_n: int) -> None:
    """Keep generation cheap: integer ``max_tokens`` / ``max_completion_tokens`` / ``n`` capped
    (chat without either gets ``max_tokens``: its default is the rest of the context).
    Other types are left alone, so negative cases stay negative."""
    body = case.body
    if not isinstance(body, dict) or not case.path.startswith("/v1/"):
        return
    for name in ("max_tokens", "max_completion_tokens"):
        if type(body.get(name)) is int:
            body[name] = min(body[name], max_tokens)
    if type(body.get("n")) is int:
        body["n"] = min(body["n"], max_n)
    if case.path == "/v1/chat/completions" and body.get("max_completion_tokens") is None:
        body.setdefault("max_tokens", max_tokens)


def check_unauthenticated(case: schemathesis.Case, **kwargs: Any) -> None:
    """With a wrong token an operation behind a bearer scheme answers 401, as documented
    (ignored_auth sends none)."""
    if not case.operation.definition.raw.get("security"):
        return
    response = case.call(headers={"Authorization": "Bearer wrong"}, **kwargs)
    assert response.status_code == 401, (case.path, response.status_code, response.text)
    case.validate_response(response, checks=RESPONSE_CHECKS)


OPERATIONS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/version"),
    ("GET", "/health"),
    ("GET", "/ready"),
    ("GET", "/load"),
    ("GET", "/metrics"),
    ("GET", ADMIN_PATH),
    ("PUT", ADMIN_PATH),
]


def fuzz(
    schema: Any,
    method: str,
    path: str,
    max_examples: int,
    max_tokens: int,
    max_n: int,
    after: Callable[[schemathesis.Case], None] | None = None,
    **call_kwargs: Any,
) -> int:
    """The schema's examples, then generated positive and negative cases of one operation,
    through :data:`CHECKS` (and unauthenticated); the number of cases run."""
    operation = schema[path][method]
    raw = operation.definition.raw
    strategies = [st.one_of(schema.get_strategies_from_examples(operation) or [st.nothing()])]
    strategies.append(operation.as_strategy(generation_mode=GenerationMode.POSITIVE))
    if "requestBody" in raw or raw.get("parameters"):  # else nothing can be made invalid
        strategies.append(operation.as_strategy(generation_mode=GenerationMode.NEGATIVE))
    num_cases = 0
    for strategy in strategies:

        @given(case=strategy)
        @settings(
            max_examples=max_examples,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
            phases=[Phase.generate, Phase.shrink],
        )
        def run(case: schemathesis.Case) -> None:
            nonlocal num_cases
            num_cases += 1
            bound(case, max_tokens, max_n)
            try:
                case.call_and_validate(headers=credentials(case), checks=CHECKS, **call_kwargs)
                check_unauthenticated(case, **call_kwargs)
            finally:
                if after is not None:
                    after(case)

        if not strategy.is_empty:
            run()
    return num_cases


# ----------------------------------------------------------------- (a) the fake engine

FAKE_SERVER_CONFIG = ServerConfig(api_key=API_KEY, admin_token=ADMIN_TOKEN)
# Examples per strategy; a deeper run by hand: ITERSERVE_FUZZ_EXAMPLES=400 (docs/reliability.md).
FAKE_EXAMPLES = int(os.environ.get("ITERSERVE_FUZZ_EXAMPLES", "40"))


@pytest.fixture(scope="module")
def fake_schema(tokenizer: Any) -> Any:
    """The schema of an app over the fake engine, called in-process (schemathesis' ASGI
    transport runs its lifespan)."""
    fake = FakeEngineClient(tokenizer, time.monotonic)
    app = build_app(fake, FAKE_SERVER_CONFIG, tokenizer=tokenizer)
    return schemathesis.openapi.from_asgi("/openapi.json", app, config=CONFIG)


def test_the_schema_is_valid_and_documents_every_operation_and_no_422(fake_schema: Any) -> None:
    fake_schema.validate()  # against the OpenAPI 3.1 meta-schema
    for result in fake_schema.get_all_operations():
        result.ok()  # raises the schema error of an operation schemathesis cannot read
    paths = fake_schema.raw_schema["paths"]
    documented = {(method.upper(), path) for path, item in paths.items() for method in item}
    assert documented == set(OPERATIONS)
    for path, item in paths.items():
        for method, operation in item.items():
            statuses = set(operation["responses"])
            if (method, path) != ("put", ADMIN_PATH):  # its 422 is the settings' own
                assert "422" not in statuses, (method, path)
    assert "HTTPValidationError" not in fake_schema.raw_schema["components"]["schemas"]


@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_fuzz_over_the_fake_engine(fake_schema: Any, method: str, path: str) -> None:
    fuzz(fake_schema, method, path, max_examples=FAKE_EXAMPLES, max_tokens=8, max_n=4)


# ----------------------------------------------- inputs the schema allows at the edges


@pytest.mark.parametrize("token_id", [-1, 2**64])
def test_echo_of_token_ids_outside_the_vocabulary_is_a_400_not_a_500(
    tokenizer: Any, token_id: int
) -> None:
    """The echo text was decoded before the ids were checked: the tokenizer's OverflowError
    answered 500."""

    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        body = {"prompt": [token_id], "echo": True}
        r = await http.post("/v1/completions", json=body, headers=AUTH)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "prompt"

    run_with_server(tokenizer, check, FAKE_SERVER_CONFIG)


@pytest.mark.parametrize(
    ("field", "value"),
    [("min_p", False), ("temperature", True), ("top_p", "0.5"), ("presence_penalty", True)],
)
def test_a_number_field_refuses_booleans_and_strings(
    tokenizer: Any, field: str, value: Any
) -> None:
    """pydantic's lax floats took ``false`` as 0.0 and ``"0.5"`` as 0.5 (the schema says
    number); an integer is still a number."""

    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        r = await http.post("/v1/completions", json={"prompt": "hi", field: value}, headers=AUTH)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
        r = await http.post("/v1/completions", json={"prompt": "hi", field: 1}, headers=AUTH)
        assert r.status_code == 200, r.text

    run_with_server(tokenizer, check, FAKE_SERVER_CONFIG)


# ----------------------------------------------------------------- (b) the real model


@pytest.fixture
def restore_settings(server: Server) -> Iterator[Callable[[schemathesis.Case], None]]:
    """Puts the session server's live settings back after a fuzzed PUT (their values; the
    version only grows), so the tests after this one see the server they expect."""
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    original = httpx.get(server.url + ADMIN_PATH, headers=admin).json()
    values = {k: v for k, v in original.items() if k not in ("config_version", "config_hash")}

    def restore(case: schemathesis.Case) -> None:
        if case.method == "PUT":
            r = httpx.put(server.url + ADMIN_PATH, json=values, headers=admin)
            assert r.status_code == 200, r.text

    yield restore
    now = httpx.get(server.url + ADMIN_PATH, headers=admin).json()
    assert now["config_hash"] == original["config_hash"]


def test_fuzz_over_the_real_model_leaves_it_healthy(
    server: Server, restore_settings: Callable[[schemathesis.Case], None]
) -> None:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", config=CONFIG)
    for method, path in OPERATIONS:
        start = time.monotonic()
        num_cases = fuzz(
            schema, method, path, max_examples=4, max_tokens=2, max_n=1, after=restore_settings
        )
        print(f"{method} {path}: {num_cases} cases in {time.monotonic() - start:.1f} s")
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
    load = httpx.get(server.url + "/load").json()
    assert (load["num_running"], load["num_waiting"]) == (0, 0), load
