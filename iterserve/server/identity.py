"""Who a request to a replica comes from: its tenant and the tiers it may use (docs/server.md,
"Tenants").

:class:`ServerAuth` checks the Bearer of ``/v1/*``, ``/tokenize``, ``/detokenize`` and
``/version`` and returns the caller's :class:`~iterserve.credentials.Grant`:

- the router token (``--router-token-file``): trusted; ``X-Tenant-Id`` (else ``user``) is the
  tenant, and the router's tier headers (``X-Iterserve-Tiers``, ``X-Iterserve-Default-Tier``)
  bound the tiers;
- a key of ``--api-keys-file``: its entry's tenant and tiers, whatever headers it sent;
- ``--api-key``, or no key where none is required: with a router token or keys file
  configured, the ``default`` tenant at any tier (its tenant headers are not trusted);
  with neither, as the request says (unauthenticated, as before either existed).

:func:`resolve_granted_priority` then maps the request's ``priority`` to a tier and refuses
(403) a tier the grant does not allow.
"""

from __future__ import annotations

from collections.abc import Iterable

from iterserve.config import ConfigError, SchedulerConfig, ServerConfig
from iterserve.credentials import (
    DEFAULT_TIER_HEADER,
    TIERS_HEADER,
    CredentialsError,
    Grant,
    tier_not_allowed,
    watch_credentials,
)
from iterserve.engine.limits import RequestLimits
from iterserve.engine.request import DEFAULT_TENANT
from iterserve.openai_http import APIError, bearer_matches, invalid_api_key

AS_SENT = Grant()  # the tenant and tier as the request says
UNTRUSTED = Grant(tenant=DEFAULT_TENANT)


class ServerAuth:
    """The replica's API credentials (see the module docstring).

    Raises:
        ConfigError: a keys or token file that cannot be read or parsed at start.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.api_key = config.api_key
        try:
            self.keys, self.token = watch_credentials(
                config.api_keys_file, config.router_token_file
            )
        except CredentialsError as e:
            raise ConfigError(str(e)) from e
        # Tenant headers are trusted from everyone only when nothing else can be.
        self.fallback = AS_SENT if self.keys is None and self.token is None else UNTRUSTED

    @property
    def requires_key(self) -> bool:
        """Whether a request without a known Bearer is refused (401)."""
        return self.api_key is not None or self.keys is not None

    def grant_for(self, authorization: bytes, headers: Iterable[tuple[bytes, bytes]]) -> Grant:
        """The grant of a request with this ``Authorization`` value and raw ASGI headers.

        Raises:
            APIError: 401 (a key is required and this one is not known); 400 (the router's
                tier headers malformed).
        """
        if self.token is not None and any(
            bearer_matches(authorization, token) for token in self.token.current()
        ):
            found = {name: value for name, value in headers if name in _TIER_HEADERS}
            try:
                return Grant.from_trusted_headers(
                    _text(found.get(TIERS_HEADER.encode())),
                    _text(found.get(DEFAULT_TIER_HEADER.encode())),
                )
            except CredentialsError as e:
                raise APIError(400, str(e)) from e
        if self.keys is not None:
            grant = self.keys.current().grant_for(authorization)
            if grant is not None:
                return grant
        if self.api_key is not None and bearer_matches(authorization, self.api_key):
            return self.fallback
        if self.requires_key:
            raise invalid_api_key()
        return self.fallback


_TIER_HEADERS = frozenset((TIERS_HEADER.encode(), DEFAULT_TIER_HEADER.encode()))


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1")


def resolve_granted_priority(
    asked: int | str | None, grant: Grant, limits: RequestLimits, tiers: SchedulerConfig
) -> tuple[int, str]:
    """The integer priority and tier name of a request's ``priority``, within ``grant``.

    A request naming no priority gets the grant's default tier when the live ``tiers`` have
    one of that name, else the server's default. An integer maps to its tier as for anyone
    (``tier_for``), then the tier is checked.

    Raises:
        APIError: 403 (``tier_not_allowed``), the tier is not one of the grant's.
        InvalidRequestError: an unknown tier name, a priority out of range.
    """
    if isinstance(asked, str) and not grant.allows(asked):
        raise tier_not_allowed(asked, grant)
    if asked is None and grant.default_tier and tiers.tier_named(grant.default_tier):
        asked = grant.default_tier
    priority = limits.resolve_priority(asked)
    tier = tiers.tier_for(priority).name
    if not grant.allows(tier):
        raise tier_not_allowed(tier, grant)
    return priority, tier
