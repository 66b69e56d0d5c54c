"""The HTTP endpoints of a replica (docs/server.md, "Endpoints").

Handlers only validate, admit and answer: generation goes through
:class:`~iterserve.server.serving.OpenAIServing`, live settings through
:mod:`~iterserve.server.live_config`; everything engine-side comes from the engine client.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import iterserve
from iterserve.engine.messages import EngineDeadError
from iterserve.server.generation import engine_error
from iterserve.server.live_config import LiveConfigError, merge
from iterserve.server.openapi import (
    ADMIN_PUT_BODY,
    TENANT_PARAMETER,
    LoadResponse,
    Status,
    errors,
    json_content,
    sse_response,
)
from iterserve.server.protocol import (
    APIError,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from iterserve.server.serving import OpenAIServing
from iterserve.server.state import ServerState

logger = logging.getLogger("iterserve.server")
router = APIRouter()

# The errors each kind of operation can answer (401s are added where auth applies, openapi.py).
GENERATION_ERRORS = errors(400, 404, 413, 429, 500, 503)
TOKENIZER_ERRORS = errors(400, 404, 413)


def state_of(request: Request) -> ServerState:
    return request.app.state.server


def serving_of(request: Request) -> OpenAIServing:
    return request.app.state.serving


# ----------------------------------------------------------------- OpenAI API


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses={**sse_response(CompletionChunk), **GENERATION_ERRORS},
    openapi_extra=TENANT_PARAMETER,
)
async def completions(req: CompletionRequest, request: Request) -> Any:
    _log_extra_fields(req)
    return await serving_of(request).completions(req, request)


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses={**sse_response(ChatCompletionChunk), **GENERATION_ERRORS},
    openapi_extra=TENANT_PARAMETER,
)
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
    _log_extra_fields(req)
    return await serving_of(request).chat(req, request)


@router.get("/v1/models", response_model=ModelList)
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


@router.post("/tokenize", response_model=TokenizeResponse, responses=TOKENIZER_ERRORS)
async def tokenize(req: TokenizeRequest, request: Request) -> dict[str, Any]:
    serving = serving_of(request)
    serving.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    if req.messages is not None and not req.messages:  # as chat completions refuse it
        raise APIError(400, "messages must hold at least one message", param="messages")
    if req.messages is not None:
        prompt = await serving.chat_prompt_async(req.messages, req.add_generation_prompt)
        tokens = prompt.token_ids
    else:
        assert req.prompt is not None
        tokens = await serving.encode_async(req.prompt, req.add_special_tokens)
    state = state_of(request)
    return {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens}


@router.post("/detokenize", response_model=DetokenizeResponse, responses=TOKENIZER_ERRORS)
async def detokenize(req: DetokenizeRequest, request: Request) -> dict[str, Any]:
    serving = serving_of(request)
    serving.check_model(req.model)
    state = state_of(request)
    limits = state.engine.limits
    bad = [t for t in req.tokens if not 0 <= t < limits.vocab_size]
    if bad:
        raise APIError(
            400, f"token ids must be in [0, {limits.vocab_size}), got {bad[:5]}", param="tokens"
        )
    return {"prompt": state.tokenizer.decode(req.tokens)}


@router.get("/version", response_model=VersionResponse)
async def version() -> dict[str, str]:
    return {"version": iterserve.__version__}


# ----------------------------------------------------------------- operations


@router.get("/health", response_model=Status, responses={503: {"model": Status}})
async def health(request: Request) -> Response:
    if state_of(request).engine.is_running:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "engine not running"}, status_code=503)


@router.get("/ready", response_model=Status, responses={503: {"model": Status}})
async def ready(request: Request) -> Response:
    state = state_of(request)
    if state.admission.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if not state.engine.is_running:
        return JSONResponse({"status": "engine not running"}, status_code=503)
    return JSONResponse({"status": "ready"})


@router.get("/load", response_model=LoadResponse, responses=errors(503))
async def load(request: Request) -> Any:
    state = state_of(request)
    if not state.engine.is_running:  # a router must not take a dead replica for an idle one
        error = APIError(503, "the engine is not running", type="service_unavailable_error")
        return JSONResponse(error.body(), status_code=503)
    load = state.engine.load
    return {
        "kv_cache_usage": load.kv_cache_usage,
        "num_running": load.num_running,
        "num_waiting": load.num_waiting,
        "num_swapped": load.num_swapped,
        "max_num_seqs": state.settings.config.max_num_seqs,
        "num_free_blocks": load.num_free_blocks,
        "num_cached_blocks": load.num_cached_blocks,
        "num_total_blocks": load.num_total_blocks,
        "config_version": state.settings.version,
        "config_hash": state.settings.view()["config_hash"],
        # A router stops sending new requests here at once (they would get 503).
        "draining": state.admission.draining,
    }


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}},
)
async def metrics(request: Request) -> Response:
    state = state_of(request)
    state.metrics.set_load(state.engine.load)
    state.metrics.set_kv_events_dropped(getattr(state.engine, "num_kv_events_dropped", 0))
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# ----------------------------------------------------------------- admin


@router.get(
    "/admin/scheduler_config",
    response_model=None,
    responses={200: json_content("SchedulerSettings"), **errors(403)},
)
async def get_scheduler_config(request: Request) -> dict[str, Any]:
    return state_of(request).settings.view()


@router.put(
    "/admin/scheduler_config",
    response_model=None,
    responses={200: json_content("SchedulerSettings"), **errors(400, 403, 413, 422, 503)},
    openapi_extra=ADMIN_PUT_BODY,
)
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
        try:
            await state.engine.update_scheduler_config(new.config)
        except EngineDeadError as e:
            raise engine_error(e) from e
        state.settings = new
        state.metrics.set_settings(new.version, new.config.tiers)
        if state.telemetry is not None:
            state.telemetry.record_config(new.version, new.config)
        logger.info("scheduler settings version %d applied: %s", new.version, new.view())
    return new.view()


_logged_extra: set[str] = set()


def _log_extra_fields(req: Any) -> None:
    """Unknown request fields are ignored; say so once per field name."""
    for name in req.model_extra or {}:
        if name not in _logged_extra:
            _logged_extra.add(name)
            logger.warning("ignoring unknown request field %r (logged once)", name)
