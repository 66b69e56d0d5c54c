"""ASGI middleware of a replica: auth before the body, request ids, the body-size limit, the
drain's count of active generation requests, arrival times, and the JSON access log."""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from iterserve.config import ServerConfig
from iterserve.openai_http import (
    APIError,
    authorization_header,
)
from iterserve.server.admin_auth import AdminTokens
from iterserve.server.identity import ServerAuth
from iterserve.server.state import ServerState

access_logger = logging.getLogger("iterserve.access")

# Requests that hold engine work: the drain on SIGTERM waits for these.
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
# Behind --api-key / --api-keys-file (the operational endpoints /health, /ready, /load,
# /metrics are not).
API_KEY_PATHS = ("/v1/", "/tokenize", "/detokenize", "/version")


class BodyTooLarge(HTTPException):
    """Raised while the body is read (a fastapi HTTPException: FastAPI re-raises those from
    its body parsing instead of turning them into a 400)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than {limit} bytes")


class ServerMiddleware:
    """Pure ASGI middleware: request ids, the body-size limit, the drain's count of active
    generation requests, and one structured (JSON) access-log line per request."""

    def __init__(
        self,
        app: ASGIApp,
        get_state: Any,
        server_config: ServerConfig,
        auth: ServerAuth | None = None,
        admin_tokens: AdminTokens | None = None,
    ) -> None:
        self.app = app
        self.get_state = get_state
        self.server_config = server_config
        self.auth = auth or ServerAuth(server_config)
        self.admin_tokens = admin_tokens or AdminTokens(server_config.admin_token)

    def _listener_error(self, scope: Scope) -> APIError | None:
        """With ``--admin-port``: ``/admin/*`` there only, and nothing else there (404, as
        for a path that does not exist: the public port does not reveal the admin API)."""
        admin_port = self.server_config.admin_port
        if admin_port is None:
            return None
        server = scope.get("server") or (None, None)
        on_admin_port = server[1] == admin_port
        if on_admin_port != scope["path"].startswith("/admin/"):
            return APIError(404, "Not Found", type="not_found_error")
        return None

    def _auth_error(self, path: str, raw_headers: list[tuple[bytes, bytes]]) -> APIError | None:
        """Checked before the body is parsed, so a bad key is 401 whatever the body."""
        authorization = authorization_header(raw_headers)
        if path.startswith("/admin/"):
            if not self.admin_tokens.enabled:
                return APIError(
                    403,
                    "the admin API is disabled; start the server with --admin-token TOKEN "
                    "(or ITERSERVE_ADMIN_TOKEN) or --admin-token-file PATH to enable it",
                    type="permission_error",
                )
            if not self.admin_tokens.matches(authorization):
                return APIError(401, "invalid or missing admin token", type="authentication_error")
            return None
        return None

    def _api_auth_error(self, scope: Scope) -> APIError | None:
        """The API paths' Bearer check (:class:`ServerAuth`); the caller's grant goes to
        ``scope["state"]["grant"]``."""
        try:
            grant = self.auth.grant_for(authorization_header(scope["headers"]), scope["headers"])
        except APIError as e:
            return e
        scope["state"]["grant"] = grant
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
        # The request counts as arrived now: queue time, TTFT and aging start here.
        scope["state"]["arrival_time"] = state.clock() if state is not None else start
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

        auth_error = self._listener_error(scope) or self._auth_error(
            scope["path"], scope["headers"]
        )
        if auth_error is None and scope["path"].startswith(API_KEY_PATHS):
            auth_error = self._api_auth_error(scope)
        if auth_error is not None:
            await error_response(auth_error)(scope, receive, send_with_id)
            self._log(scope, status, start)
            return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            error = APIError(413, f"the request body is larger than {limit} bytes")
            if state is not None:
                state.metrics.rejected.labels(reason="invalid").inc()
            await error_response(error)(scope, receive, send_with_id)
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


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
