"""The replica's OpenAPI schema (``/openapi.json``): what each operation really answers.

FastAPI documents a 422 ``HTTPValidationError`` for every operation with a body; this server
answers bad bodies with 400 in OpenAI's error shape instead (``app.py``), so the schema drops
those and documents, per operation, the answers it can give: its success body (JSON, or the
SSE stream of ``stream: true``) and its errors (:func:`errors`), all in the
:class:`~iterserve.server.protocol.ErrorResponse` shape. The routes take their ``responses``
from here; :func:`install_openapi` adds what depends on the server's settings (the bearer
schemes and their 401 where ``--api-key`` and the admin token apply), what only the running
server knows (the vocabulary's token id range, the names of the tiers in force; the schema is
built again when the live settings change) and the models only the schema names (stream
chunks, the admin PUT's body, with each setting's bounds). ``tests/server/test_fuzz.py`` checks the
server against it with schemathesis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, TypeAdapter
from pydantic.json_schema import models_json_schema

from iterserve.config import (
    LIVE_SCHEDULER_KEYS,
    MAX_AGING_INTERVAL_S,
    MAX_JSON_INT,
    MAX_TIERS,
    MIN_AGING_INTERVAL_S,
    SchedulerConfig,
    ServerConfig,
)
from iterserve.server.middleware import API_KEY_PATHS, GENERATION_PATHS
from iterserve.server.protocol import (
    TIER_NAME_SCHEMA,
    TIER_NAME_SCHEMA_NAME,
    TOKEN_ID_SCHEMA_NAME,
    ChatCompletionChunk,
    CompletionChunk,
    ErrorResponse,
)

if TYPE_CHECKING:
    from iterserve.server.state import ServerState

_REF = "#/components/schemas/{model}"

_ERROR_DESCRIPTIONS = {
    400: "Bad parameters, malformed JSON or a body that is not JSON (never FastAPI's 422).",
    403: "The admin API is disabled (start the server with --admin-token).",
    404: "The model is not the one this server serves.",
    413: "The body is larger than --max-request-body-bytes.",
    422: "Settings that cannot be applied (unknown or restart-only keys, invalid values).",
    429: "Backpressure (`code`): the queue is full (queue_full), the tenant's queue is full "
    "(tenant_queue_full, max_waiting_per_tenant), or the expected wait exceeds the tier's "
    "limit (queue_wait); retry after Retry-After seconds.",
    500: "The engine failed the iteration that computed this request.",
    503: "The engine is not running, or the server is draining (Retry-After).",
}
_RETRY_AFTER = {
    "Retry-After": {
        "description": "whole seconds, 1-60",
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    }
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for these error statuses, each an :class:`ErrorResponse`."""
    responses: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[status]}
        if status in (429, 503):
            entry["headers"] = _RETRY_AFTER
        responses[status] = entry
    return responses


def sse_response(chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The 200 ``text/event-stream`` of ``stream: true``: ``data:`` events of ``chunk`` JSON
    (an :class:`ErrorResponse` if the request fails mid-stream), then ``data: [DONE]``.

    One event's schema (OpenAPI 3.1 reads ``schema`` of an event stream per event); the
    chunk models are added to the components by :func:`install_openapi`.
    """
    json_data = {
        "contentMediaType": "application/json",
        "contentSchema": {
            "anyOf": [
                {"$ref": _REF.format(model=chunk.__name__)},
                {"$ref": _REF.format(model=ErrorResponse.__name__)},
            ]
        },
    }
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"type": "string", "if": {"const": "[DONE]"}, "else": json_data}},
    }
    return {200: {"content": {"text/event-stream": {"schema": event}}}}


# The tenant header the generation endpoints read (``tenants.resolve_tenant``).
TENANT_PARAMETER = {
    "parameters": [
        {
            "name": "X-Tenant-Id",
            "in": "header",
            "required": False,
            "description": "the request's tenant (else the body's user, else default)",
            "schema": {"type": "string"},
        }
    ]
}


# ----------------------------------------------------------------- operations and admin bodies


class Status(BaseModel):
    """``/health`` and ``/ready``: ``ok`` / ``ready``, or why not (with 503)."""

    status: str


class LoadResponse(BaseModel):
    """``GET /load``, the router's signal (docs/server.md, "/load"); ``num_*`` count sequences."""

    # A key added to the route's answer is sent (and shows in the schema as allowed) even
    # before it is declared here: a response_model would otherwise drop it.
    model_config = ConfigDict(extra="allow")

    kv_cache_usage: float  # 0-1
    num_running: int
    num_waiting: int
    num_swapped: int
    max_num_seqs: int
    num_free_blocks: int
    num_cached_blocks: int
    num_total_blocks: int
    config_version: int
    config_hash: str
    draining: bool


_BELOW_2_53 = {"maximum": MAX_JSON_INT - 1}
# The bounds SchedulerConfig checks on each live setting alone (across settings, and against
# the settings in force, only the merge can tell: 422).
_LIVE_BOUNDS: dict[str, dict[str, Any]] = {
    "max_num_seqs": {"minimum": 1, **_BELOW_2_53},
    "max_num_batched_tokens": {"minimum": 1, **_BELOW_2_53},
    "long_prefill_token_threshold": {"minimum": 0, **_BELOW_2_53},
    "kv_watermark": {"minimum": 0, "exclusiveMaximum": 1},
    "aging_interval_s": {"minimum": MIN_AGING_INTERVAL_S, "maximum": MAX_AGING_INTERVAL_S},
    "priority_preemption_margin": {"minimum": 0, **_BELOW_2_53},
    "max_waiting": {"minimum": 1, **_BELOW_2_53},
    "max_waiting_per_tenant": {"minimum": 1, **_BELOW_2_53},
}


def _tier_schema(tier: dict[str, Any]) -> dict[str, Any]:
    """A tier as a PUT may give it: unknown keys refused, the name printable, priorities
    within (-2**53, 2**53), limits positive."""
    positive = {"anyOf": [{"type": "number", "exclusiveMinimum": 0}, {"type": "null"}]}
    integer = {"type": "integer", "exclusiveMinimum": -MAX_JSON_INT}
    properties = {
        **tier["properties"],
        "name": {**TIER_NAME_SCHEMA, "description": "printable (no control or format characters)"},
        "priority": {**integer, "exclusiveMaximum": MAX_JSON_INT},
        "max_queue_wait_ms": positive,
        "ttft_target_ms": positive,
    }
    return {**tier, "properties": properties, "additionalProperties": False}


def _live_settings_schemas() -> dict[str, Any]:
    """Component schemas of the admin bodies, derived from ``SchedulerConfig`` and
    ``LIVE_SCHEDULER_KEYS`` (a live key added there is documented here):
    ``SchedulerSettings`` (a GET's answer, a PUT's) and ``SchedulerSettingsUpdate`` (a PUT's
    body: any subset, merged with the current settings and validated as a whole by
    ``live_config.merge``, 422 with the reason otherwise)."""
    full = TypeAdapter(SchedulerConfig).json_schema(ref_template=_REF)
    live = {k: v for k, v in full["properties"].items() if k in LIVE_SCHEDULER_KEYS}
    for value in live.values():
        value.pop("default", None)  # the server's start values, not a PUT's
    bounded = {k: {**v, **_LIVE_BOUNDS.get(k, {})} for k, v in live.items()}
    tiers = {**live["tiers"], "minItems": 1, "maxItems": MAX_TIERS}
    version = {"type": "integer", "minimum": 0, "maximum": 2**53 - 1}
    settings = {
        "type": "object",
        "properties": {**live, "config_version": version, "config_hash": {"type": "string"}},
        "required": [*live, "config_version", "config_hash"],
    }
    update = {
        "type": "object",
        "properties": {
            **bounded,
            "tiers": tiers,
            "config_version": {
                "anyOf": [version, {"type": "null"}],
                "description": "adopted if greater than the current one",
            },
            "config_hash": {"description": "ignored (a GET's answer may be echoed back)"},
        },
        "additionalProperties": False,  # unknown and restart-only keys: 422
        "examples": [
            {"max_num_seqs": 16, "priority_preemption_margin": 0},
            {"tiers": [{"name": "premium", "priority": 0, "max_queue_wait_ms": 500}]},
        ],
    }
    return {
        "Tier": _tier_schema(full["$defs"]["Tier"]),
        "SchedulerSettings": settings,
        "SchedulerSettingsUpdate": update,
    }


def _runtime_schemas(state: ServerState | None) -> dict[str, Any]:
    """What only the running server knows: the vocabulary (``TokenId``) and the tiers in
    force (``TierName``, a request's ``priority`` by name)."""
    token_id: dict[str, Any] = {"type": "integer", "minimum": 0}
    tier_name: dict[str, Any] = {"type": "string"}
    if state is not None:
        token_id["maximum"] = state.engine.limits.vocab_size - 1
        tier_name["enum"] = [t.name for t in state.settings.config.tiers]
    token_id["description"] = "a token id: 0 <= id < the model's vocabulary size"
    tier_name["description"] = "the name of one of the server's tiers (they change live)"
    return {TOKEN_ID_SCHEMA_NAME: token_id, TIER_NAME_SCHEMA_NAME: tier_name}


def json_content(schema_name: str, description: str = "OK") -> dict[str, Any]:
    """A response (or request body) entry of one JSON component schema."""
    schema = {"$ref": _REF.format(model=schema_name)}
    return {"description": description, "content": {"application/json": {"schema": schema}}}


ADMIN_PUT_BODY = {"requestBody": {"required": True, **json_content("SchedulerSettingsUpdate")}}


# ----------------------------------------------------------------- the schema


def install_openapi(
    app: FastAPI,
    server_config: ServerConfig,
    get_state: Callable[[], ServerState | None] = lambda: None,
) -> None:
    """Make ``app.openapi()`` (served at ``/openapi.json``) the truthful schema; it is built
    again when the live settings change (the tiers a ``priority`` may name)."""
    built_for: list[int | None] = [None]

    def openapi() -> dict[str, Any]:
        state = get_state()
        version = None if state is None else state.settings.version
        if app.openapi_schema is None or built_for[0] != version:
            app.openapi_schema = _schema(app, server_config, state)
            built_for[0] = version
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override


def _schema(app: FastAPI, server_config: ServerConfig, state: ServerState | None) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    extra: list[type[BaseModel]] = [CompletionChunk, ChatCompletionChunk, ErrorResponse]
    _, defs = models_json_schema([(m, "serialization") for m in extra], ref_template=_REF)
    extra_schemas = {**defs.get("$defs", {}), **_live_settings_schemas()}
    for name, definition in {**extra_schemas, **_runtime_schemas(state)}.items():
        schemas.setdefault(name, definition)
    bearer = {"type": "http", "scheme": "bearer"}
    components["securitySchemes"] = {"adminToken": {**bearer, "description": "--admin-token"}}
    if _requires_key(server_config):
        description = "--api-key or a key of --api-keys-file"
        components["securitySchemes"]["apiKey"] = {**bearer, "description": description}
    if server_config.admin_port is not None:  # not served on the port this schema is on
        schema["paths"] = {p: i for p, i in schema["paths"].items() if not p.startswith("/admin/")}
    for path, item in schema["paths"].items():
        for operation in item.values():
            # FastAPI's own 422 (answered 400, app.py); the admin PUT's is an ErrorResponse.
            if "HTTPValidationError" in str(operation["responses"].get("422")):
                del operation["responses"]["422"]
            scheme = _auth_scheme(path, server_config)
            if scheme is not None:
                operation["security"] = [{scheme: []}]
                operation["responses"]["401"] = _unauthorized(scheme)
            if path in GENERATION_PATHS and (
                server_config.api_keys_file or server_config.router_token_file
            ):
                operation["responses"]["403"] = json_content(
                    ErrorResponse.__name__,
                    "A priority tier the caller's key may not use (`tier_not_allowed`).",
                )
    return schema


def _auth_scheme(path: str, server_config: ServerConfig) -> str | None:
    """The bearer scheme the middleware checks on ``path``, if any."""
    if path.startswith("/admin/"):
        return "adminToken"
    if path.startswith(API_KEY_PATHS) and _requires_key(server_config):
        return "apiKey"
    return None


def _requires_key(server_config: ServerConfig) -> bool:
    return server_config.api_key is not None or server_config.api_keys_file is not None


def _unauthorized(scheme: str) -> dict[str, Any]:
    what = "admin token" if scheme == "adminToken" else "API key"
    description = f"Invalid or missing {what} (checked before the body is read)."
    return json_content(ErrorResponse.__name__, description)
