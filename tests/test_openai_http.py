"""The OpenAI error body and Bearer checks shared by the server and the router."""

from __future__ import annotations

import json

import pytest

from iterserve.openai_http import (
    APIError,
    ErrorResponse,
    authorization_header,
    bearer_credentials,
    bearer_matches,
    error_body,
    invalid_api_key,
)


def test_the_error_body_has_exactly_openais_four_fields() -> None:
    assert error_body("bad") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}
    }
    e = APIError(429, "full", "rate_limit_error", code="queue_full", headers={"retry-after": "2"})
    assert e.body() == error_body("full", "rate_limit_error", None, "queue_full")
    assert (e.status, e.headers, str(e)) == (429, {"retry-after": "2"}, "full")
    ErrorResponse.model_validate(e.body())  # the documented schema accepts it


def test_the_error_event_is_one_sse_data_line() -> None:
    event = APIError(502, "gone é", "bad_gateway", param="p").event()
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert event.count(b"\n") == 2
    assert json.loads(event[len(b"data: ") :]) == error_body("gone é", "bad_gateway", "p")


def test_invalid_api_key_is_the_servers_401() -> None:
    e = invalid_api_key()
    assert e.status == 401
    assert e.body()["error"] == {
        "message": "invalid or missing API key",
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }


@pytest.mark.parametrize(
    ("header", "credentials"),
    [
        (b"Bearer k1", b"k1"),
        (b"bearer k1", b"k1"),  # the scheme is case-insensitive (RFC 9110)
        (b"BEARER k1", b"k1"),
        (b"BeArEr k1", b"k1"),
        (b"Bearer   k1", b"k1"),  # one or more spaces after the scheme (RFC 9110's 1*SP)
        (b"Bearer", b""),
        (b"Basic azE=", None),
        (b"Bearerk1", None),
        (b"", None),
    ],
)
def test_bearer_credentials(header: bytes, credentials: bytes | None) -> None:
    assert bearer_credentials(header) == credentials


def test_bearer_matches_only_the_key_itself() -> None:
    assert bearer_matches(b"Bearer s3cret", "s3cret")
    assert bearer_matches(b"bearer s3cret", "s3cret")
    assert not bearer_matches(b"Bearer s3cre", "s3cret")
    assert not bearer_matches(b"Bearer s3cret ", "s3cret")
    assert not bearer_matches(b"Token s3cret", "s3cret")
    assert not bearer_matches(b"", "s3cret")
    # A non-ASCII key is compared as its UTF-8 bytes, as a client sends it.
    assert bearer_matches("Bearer clé".encode(), "clé")
    assert not bearer_matches("Bearer clé".encode("latin-1"), "clé")


def test_two_authorization_headers_are_no_key() -> None:
    """A wrong key and the right one together must not pass because one of them is right."""
    one = [(b"host", b"x"), (b"authorization", b"Bearer k")]
    two = [(b"authorization", b"Bearer wrong"), (b"authorization", b"Bearer k")]
    assert authorization_header(one) == b"Bearer k"
    assert authorization_header(two) == b""
    assert authorization_header([]) == b""
