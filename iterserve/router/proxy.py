"""The router's proxy: ``/v1/*``, ``/tokenize`` and ``/detokenize`` sent on to a replica,
answers relayed back.

Per request (:meth:`Proxy.__call__`): refuse what must not go on (shutdown, method, key, path),
read the body, let the shared core (:mod:`iterserve.router.decide`, the endpoint picker's too)
read it (its prefix key; a tier the client's key may not use: 403) and hold it while no
replica is ready (scale from zero), then per attempt: :meth:`~Proxy.pick` the first replica
of the core's ranking not tried yet, :meth:`~Proxy.forward` the request with the
replicas' key and relay the answer (:class:`~iterserve.router.relay.Relay`): SSE chunk by chunk
as the replica writes them, or whole. A client that goes away closes the upstream request, so
the replica aborts it and frees its KV blocks. A failure before the first byte is retried on
another replica as :class:`~iterserve.router.retry.RetryPolicy` says; when none does better the
last replica's answer (a 429 with its ``Retry-After``, a 5xx) is passed through, else a 502, or
a 503 with ``Retry-After`` when no replica is ready. Every attempt counts in the replica's
in-flight numbers (:meth:`~iterserve.router.pool.ReplicaPool.begin_attempt`).

Plain ASGI over an aiohttp client: a relayed chunk costs one read and one ``send``, no
framework layer, which is most of what a router does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import aiohttp
import yarl

from iterserve.openai_http import APIError
from iterserve.router.asgi import (
    BodyTooLarge,
    ClientGone,
    ProxiedRequest,
    Receive,
    Scope,
    Send,
    forward_headers,
    read_body,
    retry_later,
    send_error,
    send_whole,
    shutting_down,
    watch_disconnect,
)
from iterserve.router.auth import AS_SENT
from iterserve.router.config import RouterConfig
from iterserve.router.decide import Decider, Decision, no_ready_replica
from iterserve.router.metrics import RouterMetrics
from iterserve.router.pool import Backend, ReplicaPool
from iterserve.router.relay import Relay, close_when
from iterserve.router.retry import AttemptFailed, Attempts, RetryPolicy, UpstreamAnswer
from iterserve.router.scoring import Picker

logger = logging.getLogger("iterserve.router")

# Idle upstream connections are dropped before uvicorn's replicas close theirs (5 s), so a
# request never goes out on a connection the replica is closing.
KEEPALIVE_S = 4.0


class Proxy:
    """The proxied paths' ASGI app (see the module docstring).

    ``active`` holds the requests being answered; :meth:`abort_active` ends them. Requests
    go out on ``http``, the session :meth:`connected` opens for the app's lifetime.
    """

    def __init__(
        self,
        pool: ReplicaPool,
        picker: Picker,
        config: RouterConfig,
        metrics: RouterMetrics,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.pool = pool
        self.picker = picker
        self.config = config
        self.metrics = metrics
        self.retry = retry or RetryPolicy()
        self.decider = Decider(pool, picker, config, metrics)
        self.auth = self.decider.auth
        self.active: set[ProxiedRequest] = set()
        self.aborting = False
        self.http: aiohttp.ClientSession | None = None
        self.relay = Relay(pool, metrics)

    @contextlib.asynccontextmanager
    async def connected(self) -> AsyncIterator[aiohttp.ClientSession]:
        """The upstream session (``http``) for the duration of the block."""
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_S
            ),
            timeout=aiohttp.ClientTimeout(
                total=None,
                connect=self.config.connect_timeout_s,
                sock_read=self.config.read_timeout_s,
            ),
            auto_decompress=False,  # relayed as the replica encoded it
            skip_auto_headers=("User-Agent", "Content-Type"),
        )
        try:
            yield self.http
        finally:
            await self.http.close()

    def abort_active(self) -> int:
        """End the requests still open (the shutdown's grace period is over): their upstream
        requests are closed (the replicas abort them), streams end with an error event,
        requests not answered yet get a 503, and new ones get a 503 at once. How many were
        open."""
        self.aborting = True
        for request in self.active:
            request.abort()
        return len(self.active)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrival = time.perf_counter()
        request = ProxiedRequest.from_scope(scope)
        refusal = self.refusal(request)
        if refusal is not None:
            await send_error(send, refusal)
            return
        self.active.add(request)
        try:
            if await self._receive_body(request, receive, send):
                await self.route(request, send, arrival)
        except Exception:  # a bug: still an answer in OpenAI's shape, and the traceback logged
            logger.exception("proxying %s /%s failed", request.method, request.path)
            with contextlib.suppress(Exception):  # fails if the answer had started
                error = APIError(500, "the router failed on this request", "internal_server_error")
                await send_error(send, error)
        finally:
            self.active.discard(request)
            if request.watcher is not None:
                request.watcher.cancel()

    def refusal(self, request: ProxiedRequest) -> APIError | None:
        """The answer to a request that goes to no replica, or None: the router is shutting
        down (503), a method the path does not take (405), no or a wrong key (401), a ``.``
        or ``..`` path segment (404). Sets ``request.grant``."""
        if self.aborting:
            return shutting_down()
        allowed = ("GET", "POST") if request.path.startswith("v1/") else ("POST",)
        if request.method not in allowed:
            return APIError(
                405,
                f"{request.method} is not allowed on /{request.path}",
                headers={"allow": ", ".join(allowed)},
            )
        try:
            request.grant = self.auth.grant_for(request.authorization)
        except APIError as e:
            return e
        if any(part in (".", "..") for part in request.path.split("/")):
            return APIError(404, f"no such path /{request.path}", "not_found_error")
        return None

    async def _receive_body(self, request: ProxiedRequest, receive: Receive, send: Send) -> bool:
        """Read ``request``'s body and start watching for its client's disconnect; False
        when it has been answered already (too large, the client gone, the shutdown)."""
        limit = self.config.max_request_body_bytes
        request.reader = asyncio.current_task()
        try:
            request.body = await read_body(receive, request, limit)
        except BodyTooLarge:
            await send_error(send, APIError(413, f"the request body is over {limit} bytes"))
            return False
        except ClientGone:
            return False
        except asyncio.CancelledError:
            if not request.aborted or request.reader is None:
                raise
            request.reader.uncancel()  # cancelled by abort_active: a slow upload, the drain over
            await send_error(send, shutting_down())
            return False
        finally:
            request.reader = None
        request.watcher = asyncio.ensure_future(watch_disconnect(receive, request.gone))
        return True

    async def route(self, request: ProxiedRequest, send: Send, arrival: float) -> None:
        """The request read and held as the shared core says (:mod:`iterserve.router.decide`:
        a tier its key may not use is a 403; with no ready replica it waits for one, or gets
        a 503); then attempts until one answers the client or the retry policy stops; then
        the best answer the failures left (:func:`answer_after`)."""
        grant = request.grant or AS_SENT
        try:
            decision = self.decider.decide(request.method, grant, request.headers, request.body)
            if not await self.decider.hold(gone=request.gone):
                if request.aborted:  # the shutdown ended it while it was held
                    await send_error(send, shutting_down())
                return
            decision = await self.decider.with_prompt_tokens(decision)
        except APIError as refusal:
            if refusal.status == 503:
                self.metrics.requests.labels(replica="none", code="503").inc()
            await send_error(send, refusal)
            return
        auth = self.auth
        headers = forward_headers(
            request, auth.upstream_authorization(), auth.trusted_headers(grant)
        )
        attempts = Attempts(self.retry)
        while attempts.may_start(request.gone.is_set()):
            backend = self.pick(attempts, decision)
            if backend is None:
                break
            first = not attempts.tried
            attempts.started(backend.name)
            try:
                await self.forward(request, send, backend, headers, arrival if first else None)
                return
            except AttemptFailed as failure:
                attempts.failed(failure)
                if self.retry.counts_against_replica(failure):
                    self.pool.record_failure(backend, failure.reason, request=True)
                if request.gone.is_set():  # no retry for a client that left (or the shutdown)
                    if request.aborted:
                        await send_error(send, shutting_down())
                    return
        answer = answer_after(attempts)
        if isinstance(answer, UpstreamAnswer):  # e.g. a 429, then a refused connection
            await send_whole(send, answer.status, answer.headers, answer.body)
        else:
            self.metrics.requests.labels(replica="none", code=str(answer.status)).inc()
            await send_error(send, answer)

    def pick(self, attempts: Attempts, decision: Decision) -> Backend | None:
        """The replica for the next attempt (the first of the core's ranking of the replicas
        not tried yet), or None when no ready replica is left."""
        ranking = self.decider.rank(decision, exclude=attempts.tried)
        if ranking is None:
            return None
        if attempts.last is not None:  # this attempt is a retry
            self.metrics.retries.labels(reason=attempts.last.reason).inc()
        return ranking.backends[0]

    async def forward(
        self,
        request: ProxiedRequest,
        send: Send,
        backend: Backend,
        headers: dict[str, str],
        arrival: float | None,
    ) -> None:
        """One attempt at ``backend``, counted in its in-flight numbers throughout; its
        answer relayed. ``arrival`` (the first attempt's): observe the proxy overhead.

        Raises:
            AttemptFailed: before any byte went to the client.
        """
        attempt = self.pool.begin_attempt(backend)
        try:
            response = await self._request(request, backend, headers, arrival)
            if response is None:  # the client left (or the shutdown) before the headers
                if request.aborted:
                    await send_error(send, shutting_down())
                return
            # From here the response is ours to close; a disconnect closes it too.
            closer = asyncio.ensure_future(close_when(request.gone, response))
            try:
                await self.relay(request, send, backend, response)
            finally:
                closer.cancel()
                response.close()
        finally:
            self.pool.end_attempt(attempt)

    async def _request(
        self,
        request: ProxiedRequest,
        backend: Backend,
        headers: dict[str, str],
        arrival: float | None,
    ) -> aiohttp.ClientResponse | None:
        """``request`` sent to ``backend``, until its response headers; None when the client
        left first (the upstream request is closed).

        Raises:
            AttemptFailed: ``connect`` or ``timeout`` (``first_byte_timeout_s``).
        """
        assert self.http is not None, "the proxy's session is not open"
        # The path as the client encoded it (a decoded %3F or %23 would change the URL).
        url = f"{backend.url}/{request.raw_path}"
        if request.query:
            url += "?" + request.query
        sending = asyncio.ensure_future(
            self.http.request(
                request.method,
                yarl.URL(url, encoded=True),
                data=request.body or None,
                headers=headers,
                allow_redirects=False,  # a replica's redirect goes back to the client, as is
            )
        )
        if arrival is not None:  # body read, parsed, picked, sent: what the router adds
            self.metrics.proxy_overhead.observe(time.perf_counter() - arrival)
        gone = asyncio.ensure_future(request.gone.wait())
        try:
            # The client may leave while the replica works (a non-streamed answer comes
            # whole): watch for it all along.
            done, _ = await asyncio.wait(
                {sending, gone},
                timeout=self.config.first_byte_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if sending not in done:
                sending.cancel()
                with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                    (await sending).close()
                if gone in done:
                    return None
                raise AttemptFailed("timeout")
            return sending.result()
        except (TimeoutError, aiohttp.ServerTimeoutError) as e:
            raise AttemptFailed("timeout") from e
        except aiohttp.ClientError as e:  # refused, reset, closed before the headers
            raise AttemptFailed("connect") from e
        finally:
            gone.cancel()


def answer_after(attempts: Attempts) -> UpstreamAnswer | APIError:
    """What a request gets when no attempt answered it: the last replica's own answer (a 429
    or 5xx) if one gave any, else a 502 naming the last failure, else (no ready replica) a
    503; both with ``Retry-After``."""
    if attempts.answer is not None:
        return attempts.answer
    if attempts.last is not None:
        return retry_later(502, f"the replicas failed ({attempts.last.reason})", "bad_gateway")
    return no_ready_replica()
