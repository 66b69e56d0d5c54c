"""The router's own endpoints, a FastAPI app: ``/health``, ``/ready`` (503 while draining or
with no ready replica), ``/load`` (the replicas' aggregate) and ``/metrics``; its 404s and
405s in OpenAI's error shape, as the proxied paths'."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from iterserve.openai_http import error_body
from iterserve.router.metrics import RouterMetrics
from iterserve.router.pool import ReplicaPool

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


def build_control_app(pool: ReplicaPool, metrics: RouterMetrics, lifespan: Lifespan) -> FastAPI:
    """The control app over ``pool``; ``state.router`` holds ``pool``, ``metrics`` and the
    upstream ``http`` session (None until ``lifespan`` opens it); ``state.draining`` set
    turns ``/ready`` 503."""
    control = FastAPI(title="iterserve router", lifespan=lifespan)
    control.state.router = {"pool": pool, "metrics": metrics, "http": None}

    @control.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = error_body(str(exc.detail), kind)
        return JSONResponse(body, exc.status_code, headers=dict(exc.headers or {}))

    @control.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @control.get("/ready")
    async def ready() -> Response:
        if getattr(control.state, "draining", False):
            return JSONResponse({"status": "draining"}, status_code=503)
        n = len(pool.ready())
        if n:
            return JSONResponse({"status": "ready", "num_ready_replicas": n})
        return JSONResponse({"status": "no ready replica"}, status_code=503)

    @control.get("/load")
    async def load() -> dict[str, Any]:
        return pool.aggregated_load()

    @control.get("/metrics")
    async def get_metrics() -> Response:
        metrics.ready_replicas.set(len(pool.ready()))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return control
