"""A request's tenant (DESIGN.md, "HTTP API"): the ``X-Tenant-Id`` header, else the OpenAI
``user`` field, else ``default``."""

from __future__ import annotations

DEFAULT_TENANT = "default"
TENANT_HEADER = "x-tenant-id"
MAX_TENANT_LEN = 256  # longer ids are cut (they end up in SQLite rows and metric labels)


def resolve_tenant(header: str | None, user: str | None) -> str:
    """The tenant of a request.

    Args:
        header: the ``X-Tenant-Id`` header's value, if sent.
        user: the body's OpenAI ``user`` field, if sent.

    Returns:
        The first of them that is non-empty after stripping blanks (at most
        :data:`MAX_TENANT_LEN` characters), else :data:`DEFAULT_TENANT`.
    """
    for value in (header, user):
        if value is not None and (value := value.strip()):
            return value[:MAX_TENANT_LEN]
    return DEFAULT_TENANT
