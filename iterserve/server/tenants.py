"""A request's tenant (DESIGN.md, "HTTP API"): the ``X-Tenant-Id`` header, else the OpenAI
``user`` field, else ``default``."""

from __future__ import annotations

import contextlib
import unicodedata

DEFAULT_TENANT = "default"
TENANT_HEADER = "x-tenant-id"
MAX_TENANT_LEN = 256  # longer ids are cut (they end up in SQLite rows and metric labels)


def resolve_tenant(header: str | None, user: str | None) -> str:
    """The tenant of a request.

    Args:
        header: the ``X-Tenant-Id`` header's value, if sent, as the ASGI server decodes header
            bytes (latin-1): UTF-8 bytes are read as UTF-8 (``日本`` stays ``日本``).
        user: the body's OpenAI ``user`` field, if sent.

    Returns:
        The first of them that is non-empty once control and other non-printing characters
        (Unicode category C: they would reach terminals through ``iterserve report`` and break
        its table) are dropped and blanks stripped, cut to :data:`MAX_TENANT_LEN` characters;
        else :data:`DEFAULT_TENANT`.
    """
    if header is not None:
        with contextlib.suppress(UnicodeError):  # not UTF-8 bytes: keep the latin-1 reading
            header = header.encode("latin-1").decode("utf-8")
    for value in (header, user):
        if value is None:
            continue
        value = "".join(c for c in value if unicodedata.category(c)[0] != "C").strip()
        if value:
            return value[:MAX_TENANT_LEN]
    return DEFAULT_TENANT
