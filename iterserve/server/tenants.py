"""A request's tenant (docs/server.md, "Tenants"): the ``X-Tenant-Id`` header, else the OpenAI
``user`` field, else ``default``."""

from __future__ import annotations

import contextlib
import unicodedata

from iterserve.engine.request import DEFAULT_TENANT

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


OTHER_TENANT = "other"  # the label value of tenants past the label limit


class TenantLabels:
    """The ``tenant`` label value of a tenant in the per-tenant metrics, of bounded
    cardinality (docs/server.md, "Metrics").

    The first ``limit`` tenants seen keep their name, later ones are :data:`OTHER_TENANT`;
    a tenant once named keeps its name for the life of the process (no churn: a series never
    changes meaning between scrapes). :data:`DEFAULT_TENANT` is always ``default`` and does
    not count against the limit. A tenant whose name is ``other`` shares that series.

    Args:
        limit: named tenants (0: every tenant but ``default`` is ``other``).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.named: set[str] = set()

    def __call__(self, tenant: str) -> str:
        """The label value of ``tenant`` (a :func:`resolve_tenant` result)."""
        if tenant == DEFAULT_TENANT or tenant in self.named:
            return tenant
        if len(self.named) < self.limit:
            self.named.add(tenant)
            return tenant
        return OTHER_TENANT
