"""Who a proxied request comes from, and what the router tells the replica about it
(docs/router.md, "API keys and tenants").

- ``--api-keys-file``: the client's Bearer must be a key of the file; its entry's tenant
  replaces any ``X-Tenant-Id`` the client sent, and a tier name its key may not use is a 403
  before any replica is tried. An integer priority or none cannot be checked here (the tiers
  and their priorities live on the servers): the key's tiers and default tier go to the
  replica in trusted headers, and the server enforces them.
- ``--api-key``: one key, no tenant (the client's ``X-Tenant-Id`` is forwarded as sent).
- Neither: unauthenticated, as sent.

The replicas are sent ``--router-token-file``'s token (re-read on change), else
``--backend-api-key``.
"""

from __future__ import annotations

from typing import Any

from iterserve.credentials import (
    Grant,
    tier_not_allowed,
    watch_credentials,
)
from iterserve.openai_http import APIError, bearer_matches, invalid_api_key
from iterserve.router.config import RouterConfig

# A request the router forwards as the client sent it (no keys file): tenant as it says.
AS_SENT = Grant()


class RouterAuth:
    """The router's credentials (see the module docstring).

    Raises:
        CredentialsError: a keys or token file that cannot be read or parsed at start.
    """

    def __init__(self, config: RouterConfig) -> None:
        self.api_key = config.api_key
        self.backend_api_key = config.backend_api_key
        self.keys, self.token = watch_credentials(config.api_keys_file, config.router_token_file)

    def grant_for(self, authorization: bytes) -> Grant:
        """The grant of a request's ``Authorization`` header value.

        Raises:
            APIError: 401, no key or a wrong one (when keys are configured).
        """
        if self.keys is not None:
            grant = self.keys.current().grant_for(authorization)
            if grant is None:
                raise invalid_api_key()
            return grant
        if self.api_key is not None and not bearer_matches(authorization, self.api_key):
            raise invalid_api_key()
        return AS_SENT

    def tier_refusal(self, grant: Grant, body: dict[str, Any] | None) -> APIError | None:
        """The 403 for a body whose ``priority`` names a tier ``grant`` does not allow; None
        otherwise (integers and no priority are the server's to check)."""
        priority = body.get("priority") if body is not None else None
        if isinstance(priority, str) and not grant.allows(priority):
            return tier_not_allowed(priority, grant)
        return None

    def upstream_authorization(self) -> str | None:
        """The ``Authorization`` value sent to the replicas, if any."""
        # The file's first token (the others are what the replicas also accept: a rotation).
        key = self.token.current()[0] if self.token is not None else self.backend_api_key
        return f"Bearer {key}" if key else None

    def trusted_headers(self, grant: Grant) -> dict[str, str] | None:
        """The headers that replace the client's tenant and tier headers; None: the client's
        ``X-Tenant-Id`` is forwarded as sent (no keys file)."""
        return grant.trusted_headers() if self.keys is not None else None
