"""The FastAPI application of a server replica, built by :func:`build_app` around the engine.

Endpoints and error shapes are fixed in DESIGN.md ("HTTP API of a server replica"). The
engine runs in its own process (:class:`~iterserve.engine.process_engine.ProcessEngine`),
started by the app's lifespan; handlers only validate, admit, and turn engine outputs into
OpenAI responses (:mod:`iterserve.server.serving`).
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import iterserve
from iterserve.config import EngineConfig, ServerConfig
from iterserve.engine.process_engine import ProcessEngine
from iterserve.server.live_config import LiveConfigError, VersionedSettings, merge
from iterserve.server.metrics import ServerMetrics
from iterserve.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from iterserve.server.serving import OpenAIServing
from iterserve.server.state import ServerState, served_model_name

logger = logging.getLogger("iterserve.server")
access_logger = logging.getLogger("iterserve.access")

# Requests that hold engine work: the drain on SIGTERM waits for these.
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
# Behind --api-key (the operational endpoints /health, /ready, /load, /metrics are not).
API_KEY_PATHS = ("/v1/", "/tokenize", "/detokenize", "/version")


class BodyTooLarge(HTTPException):
    """Raised while the body is read (a fastapi HTTPException: FastAPI re-raises those from
    its body parsing instead of turning them into a 400)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than {limit} bytes")


class ServerMiddleware:
    """Pure ASGI middleware: request ids, the body-size limit, the drain's count of active
    generation requests, and one structured (JSON) access-log line per request."""

    def __init__(self, app: ASGIApp, get_state: Any, server_config: ServerConfig) -> None:
        self.app = app
        self.get_state = get_state
        self.server_config = server_config

    def _auth_error(self, path: str, headers: dict[bytes, bytes]) -> APIError | None:
        """Checked before the body is parsed, so a bad key is 401 whatever the body."""
        given = headers.get(b"authorization", b"")
        if path.startswith("/admin/"):
            token = self.server_config.admin_token
            if token is None:
                return APIError(
                    403,
                    "the admin API is disabled; start the server with --admin-token TOKEN "
                    "(or ITERSERVE_ADMIN_TOKEN) to enable it",
                    type="permission_error",
                )
            if not hmac.compare_digest(given, f"Bearer {token}".encode()):
                return APIError(401, "invalid or missing admin token", type="authentication_error")
        elif path.startswith(API_KEY_PATHS) and self.server_config.api_key is not None:
            expected = f"Bearer {self.server_config.api_key}".encode()
            if not hmac.compare_digest(given, expected):
                return APIError(
                    401,
                    "invalid or missing API key",
                    type="authentication_error",
                    code="invalid_api_key",
                )
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state: ServerState | None = self.get_state()
        limit = state.server_config.max_request_body_bytes if state else 4 << 20
        headers = dict(scope["headers"])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:128]
        request_id = request_id or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        start = time.monotonic()
        status = 0
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                rid = scope["state"].get("request_id", request_id)
                message["headers"] = [
                    *[(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"],
                    (b"x-request-id", rid.encode("latin-1")),
                ]
            await send(message)

        auth_error = self._auth_error(scope["path"], headers)
        if auth_error is not None:
            await _error_response(auth_error)(scope, receive, send_with_id)
            self._log(scope, status, start)
            return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            error = APIError(413, f"the request body is larger than {limit} bytes")
            if state is not None:
                state.metrics.rejected.labels(reason="invalid").inc()
            await _error_response(error)(scope, receive, send_with_id)
            self._log(scope, status, start)
            return
        generation = scope["path"] in GENERATION_PATHS
        if generation and state is not None:
            state.num_active += 1
        try:
            await self.app(scope, limited_receive, send_with_id)
        finally:
            if generation and state is not None:
                state.num_active -= 1
            self._log(scope, status, start)

    @staticmethod
    def _log(scope: Scope, status: int, start: float) -> None:
        if scope["path"] in ("/metrics", "/health", "/ready", "/load"):
            return
        entry = {
            "request_id": scope["state"].get("request_id"),
            "method": scope["method"],
            "path": scope["path"],
            "status": status,
            "duration_ms": round((time.monotonic() - start) * 1000, 1),
            "client": (scope.get("client") or ("-",))[0],
        }
        if "tier" in scope["state"]:
            entry["tier"] = scope["state"]["tier"]
        if "prompts" in scope["state"]:
            entry["prompts"] = scope["state"]["prompts"]
        access_logger.info(json.dumps(entry, ensure_ascii=False))


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more errors)"
    return message, param


def build_app(engine_kwargs: dict[str, Any], server_config: ServerConfig | None = None) -> FastAPI:
    """The replica's app; its lifespan starts the engine process and stops it.

    Args:
        engine_kwargs: engine config keywords, as for ``LLM(...)``.
        server_config: HTTP-side settings (keys, limits, grace period).

    Raises:
        ConfigError, TypeError: invalid engine keywords (checked here, before any process).
    """
    server_config = server_config or ServerConfig()
    engine_config = EngineConfig.from_kwargs(**engine_kwargs)
    holder: dict[str, ServerState] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from transformers import AutoTokenizer

        engine = ProcessEngine(engine_kwargs)
        await engine.start()
        assert engine.limits is not None and engine.model_dir is not None
        metrics = ServerMetrics()
        state = ServerState(
            engine=engine,
            tokenizer=AutoTokenizer.from_pretrained(engine.model_dir),
            model_name=served_model_name(engine_config),
            max_model_len=engine.limits.max_model_len,
            swap_space=engine_config.cache.swap_space,
            server_config=server_config,
            settings=VersionedSettings(engine.limits.scheduler, 1),
            metrics=metrics,
        )
        metrics.config_version.set(1)
        engine.on_iteration = metrics.observe_iterations
        metrics.set_state(engine.state)
        holder["state"] = state
        app.state.server = state
        app.state.serving = OpenAIServing(state)
        logger.info("serving %s (max_model_len %d)", state.model_name, state.max_model_len)
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(title="iterserve", version=iterserve.__version__, lifespan=lifespan)
    app.add_middleware(
        ServerMiddleware, get_state=lambda: holder.get("state"), server_config=server_config
    )

    def state_of(request: Request) -> ServerState:
        return request.app.state.server

    def serving_of(request: Request) -> OpenAIServing:
        return request.app.state.serving

    # ----------------------------------------------------------------- errors

    def count_invalid(request: Request, status: int) -> None:
        state = holder.get("state")
        if state is not None and status in (400, 404, 413):
            state.metrics.rejected.labels(reason="invalid").inc()

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status != 429 and exc.status != 503:
            count_invalid(request, exc.status)
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        content_type = request.headers.get("content-type", "")
        if request.method == "POST" and not content_type.startswith("application/json"):
            message = (
                f"the body must be JSON sent with Content-Type: application/json "
                f"(got {content_type or 'no Content-Type'}); {message}"
            )
        count_invalid(request, 400)
        return _error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        count_invalid(request, 413 if exc.status_code == 413 else 0)
        return _error_response(
            APIError(exc.status_code, str(exc.detail), type=kind, headers=dict(exc.headers or {}))
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error", exc_info=exc)
        return _error_response(
            APIError(500, f"internal error: {type(exc).__name__}", type="internal_error")
        )

    # ----------------------------------------------------------------- OpenAI API

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        _log_extra_fields(req)
        return await serving_of(request).completions(req, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        _log_extra_fields(req)
        return await serving_of(request).chat(req, request)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        state = state_of(request)
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "iterserve",
                    "root": state.engine.model_dir,
                    "max_model_len": state.max_model_len,
                }
            ],
        }

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest, request: Request) -> dict[str, Any]:
        serving = serving_of(request)
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            prompt = await serving.chat_prompt_async(req.messages, req.add_generation_prompt)
            tokens = prompt.token_ids
        else:
            assert req.prompt is not None
            tokens = await serving.encode_async(req.prompt, req.add_special_tokens)
        state = state_of(request)
        return {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest, request: Request) -> dict[str, Any]:
        serving = serving_of(request)
        serving.check_model(req.model)
        state = state_of(request)
        limits = state.engine.limits
        assert limits is not None
        bad = [t for t in req.tokens if not 0 <= t < limits.vocab_size]
        if bad:
            raise APIError(
                400, f"token ids must be in [0, {limits.vocab_size}), got {bad[:5]}", param="tokens"
            )
        return {"prompt": state.tokenizer.decode(req.tokens)}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": iterserve.__version__}

    # ----------------------------------------------------------------- operations

    @app.get("/health")
    async def health(request: Request) -> Response:
        if state_of(request).engine.is_running:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine not running"}, status_code=503)

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        state = state_of(request)
        if state.admission.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not state.engine.is_running:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/load")
    async def load(request: Request) -> dict[str, Any]:
        state = state_of(request)
        counts = state.engine.state
        return {
            "kv_cache_usage": counts["kv_cache_usage"],
            "num_running": counts["num_running"],
            "num_waiting": counts["num_waiting"],
            "num_swapped": counts["num_swapped"],
            "max_num_seqs": state.settings.config.max_num_seqs,
            "num_free_blocks": counts["num_free_blocks"],
            "num_cached_blocks": counts["num_cached_blocks"],
            "num_total_blocks": counts["num_total_blocks"],
            "config_version": state.settings.version,
            "config_hash": state.settings.view()["config_hash"],
        }

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state = state_of(request)
        state.metrics.set_state(state.engine.state)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ----------------------------------------------------------------- admin

    @app.get("/admin/scheduler_config")
    async def get_scheduler_config(request: Request) -> dict[str, Any]:
        return state_of(request).settings.view()

    @app.put("/admin/scheduler_config")
    async def put_scheduler_config(request: Request) -> Any:
        state = state_of(request)
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError) as e:  # RecursionError: absurdly nested JSON
            raise APIError(400, f"malformed JSON: {type(e).__name__}: {e}"[:300]) from e
        async with state.settings_lock:
            try:
                new = merge(state.settings, body, state.swap_space, state.max_model_len)
            except LiveConfigError as e:
                return JSONResponse(
                    APIError(422, str(e), code="invalid_config").body(), status_code=422
                )
            if new is None:
                return state.settings.view()
            await state.engine.update_scheduler_config(new.config)
            state.settings = new
            state.metrics.config_version.set(new.version)
            logger.info("scheduler settings version %d applied: %s", new.version, new.view())
        return new.view()

    return app


_logged_extra: set[str] = set()


def _log_extra_fields(req: Any) -> None:
    """Unknown request fields are ignored; say so once per field name."""
    for name in req.model_extra or {}:
        if name not in _logged_extra:
            _logged_extra.add(name)
            logger.warning("ignoring unknown request field %r (logged once)", name)
