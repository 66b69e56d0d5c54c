"""The server under schemathesis, against its own OpenAPI schema (``/openapi.json``).

Every operation gets positive and negative cases generated from the schema, through every
check schemathesis has (``--checks all``): a response must not be a 5xx, its status must be
documented, and its body and content type must match what the schema documents for that
status (SSE events of ``stream: true`` included); a schema-valid body is accepted and a
schema-invalid one refused, so the schema says what the server enforces. Cases are also sent
without credentials where the schema declares a bearer scheme: 401, documented. Undocumented
methods answer 405 with an ``Allow`` header naming the documented ones.

Two runs: (a) over the fake engine, in-process (every operation, many cases, seconds);
(b) over the real default model (the session server: few cases, small ``max_tokens``), then
``/health`` and a normal completion. Seeded and derandomized: CI sees the same cases.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jsonschema
import pytest
import schemathesis
from fake_engine import BLOCK_SIZE, MAX_MODEL_LEN, FakeEngineClient, run_with_server
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import CheckFunction, not_a_server_error
from schemathesis.specs.openapi import checks
from server_utils import ADMIN_TOKEN, API_KEY, Server

from iterserve.config import ServerConfig
from iterserve.server.app import build_app
from iterserve.server.serving import MAX_SEQUENCES_PER_REQUEST

# What any response must satisfy; then every check schemathesis has (`--checks all`): schema-
# valid bodies accepted, schema-invalid ones refused, undocumented methods 405 with an Allow
# header naming the documented ones, auth enforced.
RESPONSE_CHECKS: list[CheckFunction] = [
    not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
    checks.response_headers_conformance,
]
CHECKS: list[CheckFunction] = list(schemathesis.checks.CHECKS.get_all())
ADMIN_PATH = "/admin/scheduler_config"
# Credentials are the test's (credentials()), not generated ones; cases are reproducible
# through hypothesis' derandomize (fuzz()). A live PUT is merged with the settings in force,
# so a schema-valid one may still be refused (422: e.g. max_num_seqs above the budget in
# force); that is its documented answer.
CONFIG = schemathesis.Config.from_dict(
    {
        "generation": {"with-security-parameters": False},
        "operations": [
            {
                "include-path": ADMIN_PATH,
                "include-method": "PUT",
                "checks": {"positive_data_acceptance": {"expected-statuses": ["2xx", "422"]}},
            }
        ],
    }
)
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def credentials(case: schemathesis.Case) -> dict[str, str]:
    token = ADMIN_TOKEN if case.path.startswith("/admin/") else API_KEY
    return {"Authorization": f"Bearer {token}"}


def bound(case: schemathesis.Case, max_tokens: int, max_n: int) -> None:
    """Keep generation cheap and inside the limits JSON Schema cannot state (they relate two
    fields, or the model's context): integer ``max_tokens`` / ``max_completion_tokens`` / ``n``
    capped (a body without either gets ``max_tokens``),
    ``min_tokens`` at most ``max_tokens``, ``best_of`` equal to ``n``, ``seed`` at most
    ``2**63 - n``, prompts x n within the per-request sequences, texts short. Positive cases
    only: negative ones stay negative (and are refused before anything runs)."""
    body = case.body
    if not isinstance(body, dict) or not case.path.startswith("/v1/"):
        return
    if case.meta is not None and not case.meta.generation.mode.is_positive:
        return  # refused before it runs; a cap could make it valid
    for name in ("max_tokens", "max_completion_tokens", "n", "min_tokens", "best_of", "seed"):
        value = body.get(name)
        if isinstance(value, float) and value.is_integer():  # a JSON integer: 2.0 is 2
            body[name] = int(value)
    for name in ("max_tokens", "max_completion_tokens"):
        if type(body.get(name)) is int:
            body[name] = min(body[name], max_tokens)
    if type(body.get("n")) is int:
        body["n"] = min(body["n"], max_n)
    if body.get("max_completion_tokens") is None:  # else the defaults: 16, or the context
        body.setdefault("max_tokens", max_tokens)
    n = body["n"] if type(body.get("n")) is int else 1
    if type(body.get("min_tokens")) is int:
        body["min_tokens"] = min(body["min_tokens"], 1)
    if type(body.get("best_of")) is int:
        body["best_of"] = n
    if type(body.get("seed")) is int:
        body["seed"] = min(body["seed"], 2**63 - max(n, 1))
    if isinstance(body.get("prompt"), list):
        del body["prompt"][MAX_SEQUENCES_PER_REQUEST // max_n :]
    # Texts cut short, so that the prompt fits the context whatever the number of items.
    if isinstance(body.get("prompt"), str | list):
        body["prompt"] = shortened(body["prompt"])
    for message in body.get("messages") or []:
        if isinstance(message, dict) and isinstance(message.get("content"), str | list):
            message["content"] = shortened(message["content"])


def shortened(value: Any, max_chars: int = 4) -> Any:
    """``value`` with its texts (strings, text parts' ``text``) cut to ``max_chars`` (never
    to empty)."""
    if isinstance(value, str):
        return value[:max_chars]
    if isinstance(value, list):
        return [shortened(item, max_chars) for item in value]
    if isinstance(value, dict) and isinstance(value.get("text"), str):
        return {**value, "text": value["text"][:max_chars]}
    return value


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
    # A pool the size of the context: a prompt that fits max_model_len fits the pool.
    fake.limits = dataclasses.replace(fake.limits, num_kv_blocks=MAX_MODEL_LEN // BLOCK_SIZE)
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


def test_an_undocumented_method_is_405_allowing_the_documented_ones(tokenizer: Any) -> None:
    """Every path answers a method the schema does not document with 405 and an ``Allow``
    header naming exactly the documented methods (schemathesis' unsupported_method and
    allow_header_conformance; Starlette's named only the first route of a path: GET
    without PUT on the admin path)."""
    documented: dict[str, set[str]] = {}
    for method, path in OPERATIONS:
        documented.setdefault(path, set()).add(method)

    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        for path, methods in documented.items():
            for method in sorted({"GET", "PUT", "POST", "DELETE", "PATCH", "OPTIONS"} - methods):
                token = ADMIN_TOKEN if path.startswith("/admin/") else API_KEY
                r = await http.request(method, path, headers={"Authorization": f"Bearer {token}"})
                assert r.status_code == 405, (method, path, r.status_code)
                assert r.headers["Allow"] == ", ".join(sorted(methods)), (method, path)
                assert r.json()["error"]["type"] == "invalid_request_error"

    run_with_server(tokenizer, check, FAKE_SERVER_CONFIG)


HI = [{"role": "user", "content": "Hi"}]
TIERS_PUT = {"tiers": [{"name": "premium", "priority": 0}]}
# (path, method, schema component of the body, body, whether schema and server accept it):
# the refusals a schema-valid body used to get (schemathesis' positive_data_acceptance),
# each with its accepted near miss.
SCHEMA_CASES: list[tuple[str, str, str, dict[str, Any], bool]] = [
    ("/tokenize", "POST", "TokenizeRequest", {}, False),
    ("/tokenize", "POST", "TokenizeRequest", {"prompt": "a", "messages": HI}, False),
    ("/tokenize", "POST", "TokenizeRequest", {"prompt": "a", "messages": None}, True),
    ("/tokenize", "POST", "TokenizeRequest", {"messages": HI}, True),
    ("/v1/chat/completions", "POST", "ChatCompletionRequest",
     {"messages": HI, "max_tokens": 2, "top_logprobs": 2}, False),
    ("/v1/chat/completions", "POST", "ChatCompletionRequest",
     {"messages": HI, "max_tokens": 2, "top_logprobs": 2, "logprobs": True}, True),
    ("/v1/completions", "POST", "CompletionRequest",
     {"prompt": "a", "max_tokens": 2, "stream_options": {"include_usage": True}}, False),
    ("/v1/completions", "POST", "CompletionRequest",
     {"prompt": "a", "max_tokens": 2, "stream_options": None}, True),
    ("/v1/completions", "POST", "CompletionRequest", {"prompt": [-1], "max_tokens": 2}, False),
    ("/v1/completions", "POST", "CompletionRequest", {"prompt": [49152], "max_tokens": 2}, False),
    ("/v1/completions", "POST", "CompletionRequest", {"prompt": [49151.0], "max_tokens": 2}, True),
    ("/detokenize", "POST", "DetokenizeRequest", {"tokens": [-1]}, False),
    ("/v1/completions", "POST", "CompletionRequest",
     {"prompt": "a", "max_tokens": 2, "priority": "gold"}, False),
    ("/v1/completions", "POST", "CompletionRequest",
     {"prompt": "a", "max_tokens": 2, "priority": "premium"}, True),
    (ADMIN_PATH, "PUT", "SchedulerSettingsUpdate",
     {"tiers": [{"name": " \u0007", "priority": 0}]}, False),
    (ADMIN_PATH, "PUT", "SchedulerSettingsUpdate", TIERS_PUT, True),
]  # fmt: skip


def test_the_schema_says_what_the_server_enforces(tokenizer: Any) -> None:
    """Each body above is valid under ``/openapi.json`` exactly when the server accepts it
    (the token id range is the model's vocabulary, the tier names the live tiers)."""

    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        document = (await http.get("/openapi.json")).json()
        for path, method, component, body, accepted in SCHEMA_CASES:
            schema = {**document, "$ref": f"#/components/schemas/{component}"}
            valid = jsonschema.Draft202012Validator(schema).is_valid(body)
            token = ADMIN_TOKEN if path.startswith("/admin/") else API_KEY
            headers = {"Authorization": f"Bearer {token}"}
            r = await http.request(method, path, json=body, headers=headers)
            assert (valid, r.status_code == 200) == (accepted, accepted), (body, r.text)

    run_with_server(tokenizer, check, FAKE_SERVER_CONFIG)


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
