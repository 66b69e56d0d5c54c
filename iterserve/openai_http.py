"""OpenAI's HTTP conventions, shared by the server and the router: the error body and
Bearer-key checks.

Every error answer, and the last event of a stream that fails, is OpenAI's shape::

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

Clients authenticate with ``Authorization: Bearer <key>``: the scheme is case-insensitive
(RFC 9110 section 11.1), the key compared in constant time.

Imports neither the engine nor torch (the router's image has neither).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error body (the module docstring's shape)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class APIError(Exception):
    """An error answered in OpenAI's shape.

    Args:
        status: HTTP status code.
        message: what went wrong and, where possible, how to fix it.
        type: OpenAI's error type (``invalid_request_error``, ...).
        param: the offending request field, if any.
        code: a machine-readable code (``model_not_found``, ``queue_full``, ...).
        headers: extra response headers (``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON answer (:func:`error_body`)."""
        return error_body(self.message, self.type, self.param, self.code)

    def event(self) -> bytes:
        """The server-sent event that ends a failed stream: ``data: <body>`` and a blank
        line, UTF-8."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


def invalid_api_key() -> APIError:
    """The 401 for a request without the right ``Bearer`` key."""
    return APIError(
        401, "invalid or missing API key", type="authentication_error", code="invalid_api_key"
    )


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error answer (:meth:`APIError.body`), and the error event that ends a stream."""

    error: ErrorDetail


def authorization_header(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """The one ``Authorization`` header of raw ASGI ``headers`` (names lower-case); ``b""``
    when there is none or more than one (two keys are no key: the request is refused)."""
    values = [value for name, value in headers if name == b"authorization"]
    return values[0] if len(values) == 1 else b""


def bearer_credentials(authorization: bytes) -> bytes | None:
    """The credentials of an ``Authorization`` header value whose scheme is ``Bearer`` (any
    case; one or more spaces after it, RFC 9110), as sent; None for another scheme or no
    header (``b""``)."""
    scheme, _, credentials = authorization.partition(b" ")
    return credentials.lstrip(b" ") if scheme.lower() == b"bearer" else None


def bearer_matches(authorization: bytes, key: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <key>`` (``key`` UTF-8 encoded),
    compared in constant time."""
    given = bearer_credentials(authorization)
    return given is not None and hmac.compare_digest(given, key.encode())
