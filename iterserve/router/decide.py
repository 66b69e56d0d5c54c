"""What the router decides for a request, whichever way it travels: the router's own proxy
(:mod:`iterserve.router.proxy`) and the gateway's endpoint picker (:mod:`iterserve.router.epp`)
both call this one core, so a request is read, refused, held and placed the same in both
modes.

Per request:

1. :meth:`Decider.decide`: the body as JSON, a tier its key may not use refused (403,
   :mod:`iterserve.router.auth`), its prefix key, session header and tier (a
   :class:`Decision`);
2. :meth:`Decider.hold`: with no ready replica (a deployment scaled to zero), wait for one
   to turn ready, at most ``--hold-timeout-s`` and ``--max-held-requests`` at once, else
   a 503 with ``Retry-After`` (gauge ``iterserve_router_held_requests``);
3. :meth:`Decider.rank`: the replicas to try, in order (a :class:`Ranking`)::

       [the policy's pick (scoring.Picker: least_kv, prefix affinity, session, ...),
        then every other ready candidate, lowest score first]

   The proxy walks this list as it retries; the picker answers it to the gateway as the
   ordered fallback list of ``x-gateway-destination-endpoint``.
4. :meth:`Decider.shed` (the picker only): a 429 for a request of a sheddable tier when
   every candidate is saturated (:meth:`Decider.saturated`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import urllib.parse
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from iterserve.credentials import Grant
from iterserve.openai_http import APIError
from iterserve.router.asgi import RETRY_AFTER_S, retry_later
from iterserve.router.auth import RouterAuth
from iterserve.router.config import RouterConfig
from iterserve.router.metrics import RouterMetrics
from iterserve.router.pool import Backend, ReplicaPool
from iterserve.router.scoring import NoReplicaError, Picker, is_stale, prefix_key, scores


@dataclass(frozen=True)
class Decision:
    """What the router read of a request.

    Attributes:
        body: the body's JSON object; None when it is not one (or a GET).
        grant: what the client's key allows (tenant, tiers).
        key: the prefix key (:func:`~iterserve.router.scoring.prefix_key`), if any.
        session: the session header's value, if any.
        tier: the tier the request names (``priority`` as a name), else its key's default
            tier; None for an integer priority or none at all (not known here).
        prompt_token_ids: the prompt as the replicas' tokens, for the KV-event match
            (:meth:`Decider.with_prompt_tokens`); None without KV events.
    """

    body: dict[str, Any] | None
    grant: Grant
    key: bytes | None
    session: str | None
    tier: str | None
    prompt_token_ids: list[int] | None = None


@dataclass(frozen=True)
class Ranking:
    """The replicas for one request, in the order to try them (``backends[0]`` is the
    policy's pick), and the pick's reason (the ``reason`` label of the picks metric)."""

    backends: list[Backend]
    reason: str


def endpoint_of(backend: Backend) -> str:
    """A replica's ``ip:port`` (``[ipv6]:port``), as the endpoint-picker protocol writes it."""
    return urllib.parse.urlsplit(backend.url).netloc


def in_subset(backend: Backend, subset: Collection[str]) -> bool:
    """Whether ``backend`` is one of ``subset``'s endpoints: ``ip:port`` exactly, or a bare
    ``ip`` (any port of that address)."""
    where = endpoint_of(backend)
    return where in subset or urllib.parse.urlsplit(backend.url).hostname in subset


def no_ready_replica() -> APIError:
    return retry_later(503, "no ready replica; retry later", "service_unavailable_error")


class Decider:
    """The decisions of the module docstring over ``pool``, picking with ``picker``."""

    def __init__(
        self, pool: ReplicaPool, picker: Picker, config: RouterConfig, metrics: RouterMetrics
    ) -> None:
        self.pool = pool
        self.picker = picker
        self.config = config
        self.metrics = metrics
        self.auth = RouterAuth(config)
        self.session_header = config.session_header.lower()
        self.sheddable = config.sheddable
        self.num_held = 0

    def decide(
        self, method: str, grant: Grant, headers: Mapping[str, str], body: bytes
    ) -> Decision:
        """Read one request (``headers`` with lower-case names).

        Raises:
            APIError: 403, its ``priority`` names a tier ``grant`` does not allow.
        """
        data = _json_object(body) if method == "POST" else None
        if (refusal := self.auth.tier_refusal(grant, data)) is not None:
            raise refusal
        priority = data.get("priority") if data is not None else None
        tier = priority if isinstance(priority, str) else None
        if priority is None:
            tier = grant.default_tier
        return Decision(
            body=data,
            grant=grant,
            key=_prefix_key(data) if data is not None else None,
            session=headers.get(self.session_header),
            tier=tier,
        )

    async def with_prompt_tokens(self, decision: Decision) -> Decision:
        """``decision`` with its prompt's token ids when the picker matches prompts against
        the replicas' KV events (docs/router.md); tokenized on a worker thread, since a long
        prompt takes milliseconds."""
        if decision.body is None or not self.picker.wants_prompt_tokens():
            return decision
        tokens = await asyncio.to_thread(self.picker.prompt_tokens, decision.body)
        return dataclasses.replace(decision, prompt_token_ids=tokens)

    def candidates(
        self, exclude: Collection[str] = (), subset: Collection[str] | None = None
    ) -> list[Backend]:
        """The ready replicas not named in ``exclude`` and, with a ``subset``, in it."""
        return [
            b
            for b in self.pool.ready()
            if b.name not in exclude and (subset is None or in_subset(b, subset))
        ]

    def rank(
        self,
        decision: Decision,
        exclude: Collection[str] = (),
        subset: Collection[str] | None = None,
    ) -> Ranking | None:
        """The candidates in the order to try them (module docstring), counted in the picks
        metric; None when there is none."""
        ready = self.candidates(exclude, subset)
        now = time.monotonic()
        try:
            pick = self.picker.pick(
                [b.state for b in ready],
                now,
                decision.key,
                decision.session,
                decision.prompt_token_ids,
            )
        except NoReplicaError:
            return None
        self.metrics.picks.labels(policy=self.picker.policy, reason=pick.reason).inc()
        first = self.pool.named(pick.replica.name)
        s = scores([b.state for b in ready], now, self.picker.stale_after_s, self.picker.weights)
        rest = sorted((b for b in ready if b is not first), key=lambda b: (s[b.name], b.name))
        return Ranking([first, *rest], pick.reason)

    async def hold(
        self, subset: Collection[str] | None = None, gone: asyncio.Event | None = None
    ) -> bool:
        """Return once a candidate is ready: at once when one is, else after waiting for
        one (scale from zero). False when ``gone`` was set first (the client left).

        Raises:
            APIError: 503 with ``Retry-After``, when no candidate turned ready within
                ``--hold-timeout-s``, or ``--max-held-requests`` are waiting already.
        """
        if self.candidates(subset=subset):
            return True
        config = self.config
        if config.hold_timeout_s == 0 or self.num_held >= config.max_held_requests:
            raise no_ready_replica()
        # Counted now, not when answered: the scale-from-zero wake trigger (the rate of the
        # router's requests, docs/autoscaling.md) must see a request it holds at once.
        self.metrics.requests.labels(replica="none", code="held").inc()
        self._held(+1)
        try:
            async with asyncio.timeout(config.hold_timeout_s):
                while not self.candidates(subset=subset):
                    # A replica that was ejected (down) may be the one starting now.
                    self.pool.probe_soon()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self.pool.backoff_s):
                            if not await _first(self.pool.turned_ready(), gone):
                                return False
        except TimeoutError:
            raise no_ready_replica() from None
        finally:
            self._held(-1)
        return True

    def _held(self, change: int) -> None:
        self.num_held += change
        self.metrics.held_requests.set(self.num_held)

    def saturated(self, backend: Backend) -> bool:
        """Whether a replica takes no more work worth sending it: its report is missing or
        stale, or ``--shed-queue-depth`` requests wait there (its waiting queue plus what
        the router sent since its report), or its KV cache usage is ``--shed-kv-usage`` or
        more."""
        state = backend.state
        report = state.report
        if report is None or is_stale(state, time.monotonic(), self.picker.stale_after_s):
            return True
        queued = report.num_waiting + state.in_flight_since_report
        return queued >= self.config.shed_queue_depth or (
            report.kv_cache_usage >= self.config.shed_kv_usage
        )

    def shed(self, decision: Decision, ranking: Ranking) -> APIError | None:
        """The 429 for a request of a sheddable tier (``--sheddable-tiers``) when every
        candidate of ``ranking`` is saturated; None otherwise."""
        if decision.tier not in self.sheddable:
            return None
        if not all(self.saturated(b) for b in ranking.backends):
            return None
        return APIError(
            429,
            f"every replica is saturated: {decision.tier} requests are shed; retry later",
            "rate_limit_error",
            code="shed",
            headers={"retry-after": RETRY_AFTER_S},
        )


async def _first(ready: Any, gone: asyncio.Event | None) -> bool:
    """Await ``ready`` (a coroutine) or ``gone``; True when ``ready`` came first."""
    waiter = asyncio.ensure_future(ready)
    if gone is None:
        await waiter
        return True
    leaving = asyncio.ensure_future(gone.wait())
    try:
        await asyncio.wait({waiter, leaving}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (waiter, leaving):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return not gone.is_set()


def _json_object(body: bytes) -> dict[str, Any] | None:
    """A body's JSON object; None when it is not one."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _prefix_key(data: dict[str, Any]) -> bytes | None:
    """The prefix key of a generation body (a JSON object); a batch of prompts is keyed by
    its first."""
    messages = data.get("messages")
    prompt = data.get("prompt")
    if isinstance(messages, list):
        return prefix_key(messages=[m for m in messages if isinstance(m, dict)]) or None
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prefix_key(prompt) or None
    if isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
        return prefix_key(token_ids=prompt)
    return None


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
