"""The FastAPI application of a server replica: :func:`build_app` around an engine client.

The client is injected (:class:`~iterserve.engine.messages.EngineClient`): the engine in its
own process for ``iterserve serve``, on a thread for simulated replicas, a fake in tests. The
app's lifespan starts and stops it; the endpoints are in :mod:`iterserve.server.routes`, the
middleware (auth, request ids, body limit, access log) in :mod:`iterserve.server.middleware`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import iterserve
from iterserve.config import ServerConfig
from iterserve.engine.messages import (
    EngineClient,
    EngineLoad,
    EngineStartError,
    IterationStats,
)
from iterserve.server.admin_auth import AdminTokens
from iterserve.server.admission import Admission
from iterserve.server.identity import ServerAuth
from iterserve.server.live_config import VersionedSettings
from iterserve.server.metrics import ServerMetrics
from iterserve.server.middleware import ServerMiddleware, error_response
from iterserve.server.openapi import install_openapi
from iterserve.server.protocol import APIError
from iterserve.server.routes import router
from iterserve.server.serving import OpenAIServing
from iterserve.server.state import ServerState, served_model_name
from iterserve.server.telemetry import ServerTelemetry
from iterserve.telemetry.writer import TelemetryWriter

logger = logging.getLogger("iterserve.server")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    # The field all errors share: a union field fails once per member (prompt.str,
    # prompt.list[str], ...), and the field is what the client sent wrong.
    locs = [[str(x) for x in e.get("loc", ()) if x != "body"] for e in errors]
    shared = locs[0]
    for loc in locs[1:]:
        pairs = itertools.takewhile(lambda p: p[0] == p[1], zip(shared, loc, strict=False))
        shared = [a for a, _ in pairs]
    param = ".".join(shared) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more errors)"
    return message, param


def build_app(
    engine_client: EngineClient,
    server_config: ServerConfig | None = None,
    tokenizer: Any = None,
    clock: Callable[[], float] = time.monotonic,
) -> FastAPI:
    """The replica's app; its lifespan starts ``engine_client`` and stops it.

    Args:
        engine_client: the engine, not started yet.
        server_config: HTTP-side settings (keys, limits, grace period).
        tokenizer: a Hugging Face tokenizer of the model (default: loaded from the client's
            ``model_dir`` once it has started).
        clock: monotonic seconds for arrival times, latencies and admission (tests pass a
            fake one).

    Raises:
        ConfigError: ``--api-keys-file`` or ``--router-token-file`` unreadable or invalid.
        ConfigError: ``server_config.admin_token_file`` cannot be read or holds no token.
    """
    server_config = server_config or ServerConfig()
    auth = ServerAuth(server_config)  # a bad keys or token file fails here, before any start
    holder: dict[str, ServerState] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # transformers' tokenizer classes take seconds to import: in a thread while the engine
        # process starts (a server was ready 3 s later when they came after it). A daemon
        # thread: an engine that fails to start ends the server without waiting for it; else
        # it is waited for (importing transformers from two threads at once can find it half
        # initialised: "cannot import name 'AutoTokenizer'").
        importer = None
        if tokenizer is None:
            importer = threading.Thread(target=_import_tokenizers, name="import", daemon=True)
            importer.start()
        try:
            await engine_client.start()
        except EngineStartError as e:
            app.state.start_error = e  # run_server turns bad settings into a ConfigError
            raise EngineStartError(str(e), e.bad_settings) from None
        try:
            if importer is not None:
                await asyncio.to_thread(importer.join)
            holder["state"] = state = _server_state(engine_client, server_config, tokenizer, clock)
            app.state.server = state
            app.state.serving = OpenAIServing(state)
            logger.info("serving %s (max_model_len %d)", state.model_name, state.max_model_len)
            yield
        finally:
            await engine_client.stop()
            started = holder.get("state")
            if started is not None and started.telemetry is not None:
                started.telemetry.close()

    app = FastAPI(title="iterserve", version=iterserve.__version__, lifespan=lifespan)
    app.add_middleware(
        ServerMiddleware,
        get_state=lambda: holder.get("state"),
        server_config=server_config,
        auth=auth,
        # Read now: a missing or empty token file is the CLI's exit 2, before the engine starts.
        admin_tokens=AdminTokens(server_config.admin_token, server_config.admin_token_file),
    )
    _add_error_handlers(app, holder)
    app.include_router(router)
    install_openapi(app, server_config, lambda: holder.get("state"))
    return app


def _import_tokenizers() -> None:
    # (Not at a lower priority: at nice 19 a busy machine starved it, and servers waited for it
    # longer than the import takes in turn.)
    with contextlib.suppress(Exception):  # a failed import fails again where it is needed
        from transformers import AutoTokenizer  # noqa: F401


def _server_state(
    engine: EngineClient, server_config: ServerConfig, tokenizer: Any, clock: Callable[[], float]
) -> ServerState:
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(engine.model_dir)
    config = engine.config
    assert config.model.max_model_len is not None  # resolved by the engine
    metrics = ServerMetrics(server_config.tenant_label_limit)
    state = ServerState(
        engine=engine,
        tokenizer=tokenizer,
        model_name=served_model_name(config),
        max_model_len=config.model.max_model_len,
        swap_space=config.cache.swap_space,
        server_config=server_config,
        settings=VersionedSettings(engine.limits.scheduler, server_config.config_version),
        metrics=metrics,
        clock=clock,
        admission=Admission(clock),
    )
    metrics.set_settings(state.settings.version, state.settings.config.tiers)
    metrics.set_cache_config(engine.limits.block_size, engine.limits.num_kv_blocks)
    engine.on_iteration = metrics.observe_iterations
    if server_config.telemetry_db:
        state.telemetry = _start_telemetry(state, server_config.telemetry_db)
    metrics.set_load(engine.load)
    return state


def _start_telemetry(state: ServerState, path: str) -> ServerTelemetry:
    """The HTTP process's writer (the engine's writes ``scheduler_iterations`` itself), the
    start's ``scheduler_config`` row, and the drop counter of both writers."""
    metrics, engine = state.metrics, state.engine

    def on_drop(table: str, count: int) -> None:
        metrics.telemetry_dropped.labels(table=table).inc(count)

    telemetry = ServerTelemetry(
        TelemetryWriter(path, on_drop=on_drop), engine.config, state.model_name, state.clock
    )
    telemetry.record_config(state.settings.version, state.settings.config)
    engine_dropped = metrics.telemetry_dropped.labels(table="scheduler_iterations")
    seen = [0]

    def on_iteration(iterations: list[IterationStats], load: EngineLoad) -> None:
        metrics.observe_iterations(iterations, load)
        num_dropped = getattr(engine, "num_telemetry_dropped", 0)
        if num_dropped > seen[0]:
            engine_dropped.inc(num_dropped - seen[0])
            seen[0] = num_dropped

    engine.on_iteration = on_iteration
    return telemetry


def _add_error_handlers(app: FastAPI, holder: dict[str, ServerState]) -> None:
    """OpenAI's error shape for every error; 400 (not FastAPI's 422) for bad bodies."""

    # ----------------------------------------------------------------- errors

    def count_invalid(request: Request, status: int) -> None:
        state = holder.get("state")
        if state is not None and status in (400, 404, 413):
            state.metrics.rejected.labels(reason="invalid").inc()

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status != 429 and exc.status != 503:
            count_invalid(request, exc.status)
        return error_response(exc)

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
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        count_invalid(request, 413 if exc.status_code == 413 else 0)
        headers = dict(exc.headers or {})
        if exc.status_code == 405 and (allowed := allowed_methods(app, request.url.path)):
            headers["Allow"] = ", ".join(allowed)  # Starlette's names one route's methods
        return error_response(
            APIError(exc.status_code, str(exc.detail), type=kind, headers=headers)
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error", exc_info=exc)
        return error_response(
            APIError(500, f"internal error: {type(exc).__name__}", type="internal_error")
        )


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """The methods ``/openapi.json`` documents for ``path`` (a 405's ``Allow``), sorted."""
    return sorted(method.upper() for method in app.openapi()["paths"].get(path, {}))
