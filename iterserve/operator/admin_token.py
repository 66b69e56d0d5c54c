"""The admin token of an ``LLMDeployment``'s server pods: read from the Secret ``N-admin`` and
rotated on request (docs/kubernetes.md, "Rotating the admin token").

The Secret's key ``token`` holds the accepted tokens, one per line, the current one first; the
server pods mount it and accept every line (``--admin-token-file``, re-read on change). A
rotation, asked for by setting the resource's annotation :data:`ROTATE_ANNOTATION` to a value
it has not had, writes ``NEW\\nCURRENT``: the old token stays accepted while the kubelet
refreshes each pod's file (up to about a minute), and the push sends the new one first and
the old one on a 401. The previous token is dropped at the next rotation, which waits until
every ready pod accepts the current token (else a pod still on the file before it would
accept neither).
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Mapping
from typing import Any

from iterserve import credentials
from iterserve.operator.builders import ADMIN_TOKEN_KEY, Context, admin_secret_name
from iterserve.operator.kube import Kube
from iterserve.operator.push import PodTarget, pods_refusing
from iterserve.operator.spec import SpecError

ROTATE_ANNOTATION = "iterserve.io/rotate-admin-token"
# The status key holding the annotation value last acted on (a rotation happens once per value).
ROTATED_STATUS = "adminTokenRotation"

Event = tuple[str, str, str]  # (type, reason, message), as reconcile.Outcome's


def new_token() -> str:
    """A random token: 32 bytes, URL-safe base64 (43 characters), never starting with ``-``
    (one in 64 would, and a command line such as ``--admin-token TOKEN`` or
    ``curl -H ...`` takes it for an option)."""
    while (token := secrets.token_urlsafe(32)).startswith("-"):
        pass
    return token


def parse_tokens(secret: Mapping[str, Any]) -> tuple[str, ...]:
    """The tokens of the admin Secret's key ``token``, the current one first, as the pods'
    ``--admin-token-file`` reads them (:func:`iterserve.credentials.parse_tokens`).

    Raises:
        SpecError: not base64, no token, or a token the pods refuse (not ASCII, whitespace
            inside a line, control characters; each line's ends are stripped).
    """
    name = (secret.get("metadata") or {}).get("name", "the admin Secret")
    try:
        data = base64.b64decode(secret["data"][ADMIN_TOKEN_KEY], validate=True)
    except ValueError as e:  # binascii.Error
        raise SpecError(f"Secret {name}: key token is not base64 ({e})") from e
    try:
        return credentials.parse_tokens(data, f"Secret {name}: key token")
    except credentials.CredentialsError as e:
        raise SpecError(f"{e} (one token per line)") from e


async def rotate_if_asked(
    kube: Kube,
    ctx: Context,
    body: Mapping[str, Any],
    tokens: tuple[str, ...],
    pods: list[PodTarget],
    timeout_s: float,
) -> tuple[tuple[str, ...], dict[str, str], list[Event]]:
    """Rotate the admin token when :data:`ROTATE_ANNOTATION` holds a value not yet acted on
    and every ready pod accepts the current token.

    Returns:
        (the tokens to push with, current first; the status keys to write; events).

    Raises:
        kubernetes ApiException: the Secret could not be patched (retry).
    """
    annotations = (body.get("metadata") or {}).get("annotations") or {}
    wanted = annotations.get(ROTATE_ANNOTATION)
    if wanted is None or wanted == (body.get("status") or {}).get(ROTATED_STATUS):
        return tokens, {}, []
    name = admin_secret_name(ctx.name)
    # The Secret records the value it was rotated for: a reconcile whose body predates the
    # status of the one that rotated (a resync right after it) must not rotate again, which
    # dropped the previous token the pods still held.
    secret = await kube.get("v1", "Secret", ctx.namespace, name) or {}
    if ((secret.get("metadata") or {}).get("annotations") or {}).get(ROTATE_ANNOTATION) == wanted:
        return tokens, {ROTATED_STATUS: wanted}, []
    refusing = await pods_refusing(pods, tokens[0], timeout_s)
    if refusing:
        message = (
            f"waiting for pods {', '.join(sorted(refusing))} to accept the current admin token "
            "(the kubelet refreshes their Secret volume within about a minute)"
        )
        return tokens, {}, [("Normal", "AdminTokenRotationWaiting", message)]
    rotated = (new_token(), tokens[0])
    text = "\n".join(rotated) + "\n"
    await kube.patch({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": name, "namespace": ctx.namespace, "annotations": {ROTATE_ANNOTATION: wanted}
        },
        "data": {ADMIN_TOKEN_KEY: base64.b64encode(text.encode()).decode()},
    })  # fmt: skip
    message = f"Secret {name}: a new admin token; the previous one accepted until the next rotation"
    return rotated, {ROTATED_STATUS: wanted}, [("Normal", "AdminTokenRotated", message)]
